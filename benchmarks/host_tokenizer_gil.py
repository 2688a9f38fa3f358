"""How long tokenizing a long prompt on a worker thread stops an event loop, on the CPU.

    python -m benchmarks.host_tokenizer_gil [--tokens 1024,16384] [--rounds 5]

The ingress tokenizes each prompt on a worker thread (`asyncio.to_thread` in
`platform/ingress/prepare.py`) so that its event loop keeps streaming other requests' tokens. A
thread helps only while the work lets go of the GIL. Here an event loop ticks every 0.2 ms while a
worker thread decodes a prompt of random V4 token ids (what the ingress does with a token-id
prompt) and encodes that prompt's text (what it does with a text prompt), `--rounds` times each;
the loop's lag (how late each tick ran) is recorded for the `tokenizers` library's one-input calls
and for `antumbra.replicas.model.tokenizer.Tokenizer`'s (the library's batch calls). Ratios:
`tokenizer_loop_lag_max_<op>_<tokens>_vs_single`, the worst lag of the product's call over the
one-input call's, with the lag of an idle loop beside them. Writes
benchmarks/results/host-tokenizer-gil.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from .lib.records import RESULTS_DIR, provenance
from .lib.timing import percentile

TICK_S = 0.0002
V4_VOCAB = 129_280


async def _loop_lag(work: Callable[[], object] | None, rounds: int) -> dict[str, float]:
    """Ticks of the running loop while `work` runs `rounds` times on a worker thread (or, with no
    work, for 0.2 s): the lag of each tick behind its due time, ms."""
    lags: list[float] = []
    done = asyncio.Event()

    async def worker() -> None:
        if work is None:
            await asyncio.sleep(0.2)
        else:
            for _ in range(rounds):
                await asyncio.to_thread(work)
        done.set()

    task = asyncio.create_task(worker())
    while not done.is_set():
        due = time.perf_counter() + TICK_S
        await asyncio.sleep(TICK_S)
        lags.append(max(0.0, time.perf_counter() - due) * 1e3)
    await task
    return {"max_ms": max(lags), "p99_ms": percentile(lags, 0.99), "ticks": len(lags)}


def measure(token_counts: list[int], rounds: int) -> dict[str, Any]:
    from antumbra.replicas.model.tokenizer import Tokenizer, save_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.from_dir(save_tokenizer(tmp))
    raw = tok._tok  # the library's tokenizer, for its one-input calls
    rng = random.Random(0)
    out: dict[str, Any] = {"idle": asyncio.run(_loop_lag(None, rounds)), "cases": {}, "ratios": {}}
    for n in token_counts:
        ids = [rng.randrange(V4_VOCAB) for _ in range(n)]
        text = tok.decode(ids, skip_special_tokens=False)
        calls: dict[str, dict[str, Callable[[], object]]] = {
            "decode": {"single": partial(raw.decode, ids, skip_special_tokens=False),
                       "product": partial(tok.decode, ids, skip_special_tokens=False)},
            "encode": {"single": partial(raw.encode, text, add_special_tokens=False),
                       "product": partial(tok.encode, text, add_bos=False)},
        }
        for op, variants in calls.items():
            case = {name: asyncio.run(_loop_lag(call, rounds)) for name, call in variants.items()}
            out["cases"][f"{op}_{n}"] = case
            out["ratios"][f"tokenizer_loop_lag_max_{op}_{n}_vs_single"] = (
                case["product"]["max_ms"] / case["single"]["max_ms"])
            print(op, n, {k: round(v["max_ms"], 2) for k, v in case.items()}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,16384")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(t) for t in args.tokens.split(",")]
    result = {**provenance("cpu"), "tick_s": TICK_S, "rounds": args.rounds, **measure(counts, args.rounds)}
    out = RESULTS_DIR / "host-tokenizer-gil.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
