"""Do the decode paths agree on the H200, and which one is nearer a float32 engine? (issue 15)

The release fixed-shape step and the HiSparse fixed-shape step each failed their agreement gate
on the H200 (logprob differences of 0.50 and 0.11 over agreeing greedy tokens), while on the CPU
interpreter every pair agrees to ~2e-6. Two bf16 paths may differ because one of them is wrong or
because both round differently; a float32 engine over the same weights tells which is nearer the
arithmetic both approximate. So for each mode (exact, release, HiSparse) this script decodes
AGREE_TOKENS greedy tokens of one prompt on

  fixed     the fixed-shape decode step
  general   the general step
  fp32      the general step of a float32 engine (the oracle)
  fixed32   the fixed-shape step of a float32 engine
  fp32n, generaln  fp32 / general with the embedding table nudged by about one ulp (the spread two
            right paths may show in a mode: release rounds activations, KV rows and indexer keys to
            FP8 / FP4, so a 1e-7 change can flip a code and part two paths at 1e-3 and more)

The float32 engines keep every weight dense (the packed values, exactly) and run the general step
(every prefill) in PyTorch, so fp32 and fixed32 decode the same prefill; between them only the
decode steps differ, in float32, where two right paths agree to ~1e-5 and a wrong one shows.

and reports each pair's agreement (`engine_gpu._agreement`), the top-1/top-2 logprob margin at
the step where two paths part (a near-tie there is rounding, a wide margin is a bug), and each bf16
path's mean and max logprob distance to the oracle over their agreeing tokens.

The float32 engine needs the general-step kernels to fit the H200's shared memory in float32; where
they do not, `recompute` is the oracle: for each path's first RECOMPUTE tokens t, a fresh prefill of
prompt + t[:j] on a general engine (without HiSparse: it must equal HiSparse off) gives the logprob
of t[j] from the prefill's last position, a path independent of both decode steps.
Results: benchmarks/results/<date>-h200-decode-agreement.json (`--smoke`: CPU, the small slice).
"""

from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

import torch

from .common import environment, write_result
from .engine_gpu import (
    AGREE_TOKENS,
    SMOKE_SLICE,
    SliceSpec,
    _agreement,
    _prompts,
    _release,
    build_engine,
    build_hf,
)

Greedy = dict[str, list[Any]]  # tokens, chosen logprobs, top-1/top-2 margins
RECOMPUTE = 4


def greedy(engine: Any, prompt: list[int]) -> Greedy:
    """AGREE_TOKENS greedy tokens after `prompt` (nothing cached): each one's logprob and the
    margin between the best and second-best logprob at its step."""
    from antumbra import SamplingParams

    engine.clear_cache()
    params = SamplingParams(max_tokens=AGREE_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    out = engine.generate([prompt], params)[0]
    margins = []
    for step in out.logprobs:
        best = sorted(step.values(), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return {"tokens": list(out.token_ids),
            "logprobs": [step[t] for step, t in zip(out.logprobs, out.token_ids, strict=True)],
            "margins": margins}


def recompute(oracle: Any, prompt: list[int], run: Greedy) -> dict[str, list[Any]]:
    """The oracle's logprob of each of the run's tokens 1..RECOMPUTE, each from a fresh prefill of
    the prompt and the run's tokens before it -> |difference| to the run's, and whether the
    oracle's greedy token is the run's."""
    from antumbra import SamplingParams

    diffs: list[float | None] = []
    same: list[bool] = []
    for j in range(1, min(RECOMPUTE, len(run["tokens"]) - 1) + 1):
        oracle.clear_cache()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=8)
        out = oracle.generate([prompt + run["tokens"][:j]], params)[0]
        theirs = out.logprobs[0].get(run["tokens"][j])
        diffs.append(None if theirs is None else abs(theirs - run["logprobs"][j]))
        same.append(out.token_ids[0] == run["tokens"][j])
    return {"logprob_diffs": diffs, "same_token": same}


def compare(a: Greedy, b: Greedy) -> dict[str, Any]:
    """Agreement of two greedy runs, and where they part, both runs' margins at that step."""
    row = _agreement((a["tokens"], a["logprobs"]), (b["tokens"], b["logprobs"]))
    n = row["leading_tokens_agree"]
    diffs = [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n], strict=True)]
    row["mean_logprob_diff"] = sum(diffs) / len(diffs) if diffs else 0.0
    row["logprob_diffs"] = diffs
    if n < len(a["tokens"]):
        row["margins_where_parted"] = [a["margins"][n], b["margins"][n]]
    return row


def modes(args: argparse.Namespace) -> list[tuple[str, int, dict[str, Any], list[str]]]:
    """(mode, context, build kwargs of the fixed-shape engine, paths), the two failed gates first;
    the general and fp32 engines add decode="off" (and dtype float32)."""
    paths = args.paths.split(",")
    out = [("release", args.ctx, {"numerics": "release"}, paths)]
    if args.hisparse_ctx:
        out.append(("hisparse", args.hisparse_ctx, {"hisparse_rows": args.hisparse_rows}, paths))
    out.append(("exact", args.ctx, {}, paths))
    if args.long_ctx:  # where round four's calibration parted at the third token
        out.append(("exact_long", args.long_ctx, {}, paths))
    return out


NUDGE = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7}  # relative, about an ulp of each dtype


def nudged(engine: Any) -> Any:
    """The engine with its embedding table scaled by 1 + NUDGE (one ulp, roughly, of every entry)."""
    weight = engine.core.model.model.embed_tokens.weight
    with torch.no_grad():
        weight.mul_(1.0 + NUDGE[weight.dtype])
    return engine


def engine_for(hf: Any, device: str, mode: str, path: str, ctx: int, kwargs: dict[str, Any]) -> Any:
    if path.endswith("n"):
        return nudged(engine_for(hf, device, mode, path[:-1], ctx, kwargs))
    fp32 = path in ("fp32", "fixed32")
    fixed = path in ("fixed", "fixed32")
    build = dict(kwargs)
    build["decode"] = "on" if fixed else "off"
    if path == "oracle":
        build.pop("hisparse_rows", None)
    if fp32:
        build.update(dense=True, general_kernels="off")
    return build_engine(hf, device, "float32" if fp32 or device != "cuda" else "bfloat16",
                        max_model_len=ctx + 256, max_num_seqs=2, num_virtual_tokens=2 * ctx + 8192, **build)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = SMOKE_SLICE if args.smoke else SliceSpec()
    hf = build_hf(spec, device, torch.bfloat16 if device == "cuda" else torch.float32)
    name = ("h200" if device == "cuda" else "cpu") + "-decode-agreement" + ("-smoke" if args.smoke else "")
    result: dict[str, Any] = {**environment(), "agree_tokens": AGREE_TOKENS, "modes": {}}
    for mode, ctx, kwargs, paths in modes(args):
        prompt = _prompts(spec.vocab_size, 1, ctx, seed=ctx + 1, shared=0)[0]
        runs: dict[str, Greedy] = {}
        row: dict[str, Any] = {"ctx": ctx, "kwargs": kwargs, "seconds": {}, "plan_decode": {},
                               "recompute": {}}
        result["modes"][mode] = row
        for path in paths:
            start = time.perf_counter()
            try:
                engine = engine_for(hf, device, mode, path, ctx, kwargs)
                row["plan_decode"][path] = engine.plan.decode.value
                runs[path] = greedy(engine, prompt)
                _release(engine)
                row["seconds"][path] = time.perf_counter() - start
            except Exception as exc:  # one failing path must not hide the others' figures
                row["seconds"][path] = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-3000:]}
            print(mode, path, row["seconds"][path], flush=True)
            write_result(name, result)
        row["runs"] = runs
        if args.recompute and runs:
            start = time.perf_counter()
            try:
                oracle = engine_for(hf, device, mode, "oracle", ctx, kwargs)
                row["recompute"] = {path: recompute(oracle, prompt, r) for path, r in runs.items()}
                _release(oracle)
            except Exception as exc:
                row["recompute"] = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-3000:]}
            row["seconds"]["recompute"] = time.perf_counter() - start
            print(mode, "recompute", row["recompute"], flush=True)
        pairs = [("fixed", "general"), ("fixed32", "fp32"), ("fixed", "fp32"), ("general", "fp32"),
                 ("fp32n", "fp32"), ("generaln", "general")]
        row["pairs"] = {f"{a}_vs_{b}": compare(runs[a], runs[b]) for a, b in pairs if a in runs and b in runs}
        for key, pair in row["pairs"].items():
            print(mode, key, {k: v for k, v in pair.items() if k != "logprob_diffs"}, flush=True)
        write_result(name, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="the small slice (CPU check of the script)")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--hisparse-ctx", type=int, default=16384)
    parser.add_argument("--hisparse-rows", type=int, default=2048)
    parser.add_argument("--long-ctx", type=int, default=65536, help="exact fixed vs general there (0: skip)")
    parser.add_argument("--paths", default="fixed,general",
                        help="of fixed, general, fp32, fixed32, fp32n, generaln")
    parser.add_argument("--recompute", type=int, default=1, help="0: no recompute oracle")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
