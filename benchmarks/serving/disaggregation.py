"""Prefill / decode disaggregation on the CPU: decode inter-token latency with long prompts arriving,
bytes moved per request against the arithmetic, and the two transports.

Workload (tiny checkpoint): 4 decoding requests (32-token prompts, 96 new tokens each) run while 4
long prompts (2048 tokens, 4 new tokens) arrive at decode steps 10, 30, 50 and 70.
* colocated: one engine serves all (the whole prompt in one step, and chunked at 256 tokens);
* PD: the decoding requests run on a decode engine in this process; each long prompt is reserved
  there, computed by a prefill engine in a Ray actor (another process), its KV sent through Ray's
  object store and adopted between two decode steps, then decoded to the end on the decode engine.
Both engines are stepped by hand; each process runs one intra-op thread. ITL = time between two
tokens of a decoding request (p50 / p99 / max over all of them).

Bytes: every payload's size against `row_arithmetic` (rows x row bytes per pool, from the layout),
in exact (fp32 rows) and release (FP8 / FP4 codes) numerics, and what sending every SWA row of the
prompt would cost instead of one window. Transports: one 2048-token payload, median of 5, through
Ray's object store (put in an actor, get here) and gloo point-to-point (two ranks in this process,
over loopback TCP).

    python -m benchmarks run platform --only disaggregation [--smoke]

A smoke run is the same workload: the tiny model is small already.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..lib.context import Context

DEVICE = "cpu"

DECODE_PROMPT, DECODE_TOKENS, NUM_DECODES = 32, 96, 4
LONG_PROMPT, LONG_TOKENS, ARRIVALS = 2048, 4, (10, 30, 50, 70)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(5, 261, (n,), generator=g).tolist()  # noqa: E731
    return [draw(DECODE_PROMPT) for _ in range(NUM_DECODES)], [draw(LONG_PROMPT) for _ in ARRIVALS]


def _engine(model: Path, numerics: str = "exact", chunk: int | None = None) -> Any:
    from antumbra import Engine
    from antumbra.config import CacheConfig, SchedulerConfig

    return Engine.from_pretrained(
        model,
        cache=CacheConfig(num_virtual_tokens=16384),
        numerics=numerics,
        scheduler=SchedulerConfig(max_model_len=4096, max_prefill_chunk_tokens=chunk),
    )


def _params(n: int) -> Any:
    from antumbra import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _itl_summary(stamps: dict[str, list[float]]) -> dict[str, float]:
    gaps = sorted(b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False))
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * p99,
        "itl_max_ms": 1e3 * gaps[-1],
        "num_gaps": len(gaps),
    }


def _warm(core: Any) -> None:
    rid = core.add_request(list(range(5, 300)), _params(4))
    core.run_until_finished([rid])


def colocated(model: Path, chunk: int | None) -> dict[str, Any]:
    core = _engine(model, chunk=chunk).core
    _warm(core)
    decodes, longs = _prompts()
    ids = [core.add_request(p, _params(DECODE_TOKENS), f"d{i}") for i, p in enumerate(decodes)]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    step = 0
    while core.has_work():
        if step in ARRIVALS:
            rid = core.add_request(longs[ARRIVALS.index(step)], _params(LONG_TOKENS), f"long{step}")
            arrived[rid] = time.perf_counter()
        for out in core.step():
            now = time.perf_counter()
            if out.request_id in stamps:
                stamps[out.request_id].append(now)
            elif out.request_id in arrived and len(out.token_ids) == 1 and out.new_token_ids:
                ttft.append(now - arrived[out.request_id])
        step += 1
    return {**_itl_summary(stamps), "long_ttft_ms": [1e3 * t for t in ttft], "decode_steps": step}


def disaggregated(model: Path) -> dict[str, Any]:
    import ray

    from antumbra.replicas.kv_transfer.adopt import adopt, reserve
    from antumbra.replicas.kv_transfer.transport import RayObjectTransport

    @ray.remote(num_cpus=0)
    class Prefill:
        def __init__(self, path: str) -> None:
            torch.set_num_threads(1)
            self.engine = _engine(Path(path))
            self.engine.disaggregation.prefill_export(list(range(5, 300)), _params(4))  # warm-up

        def prefill(self, prompt: list[int], skip: int, rid: str) -> Any:
            started = time.perf_counter()
            pd = self.engine.disaggregation
            payload = pd.prefill_export(prompt, _params(LONG_TOKENS), skip, request_id=rid)
            return RayObjectTransport().send(payload), time.perf_counter() - started

    prefill = Prefill.remote(str(model))
    ray.get(prefill.__ray_ready__.remote())
    core = _engine(model).core
    _warm(core)
    decodes, longs = _prompts()
    ids = [core.add_request(p, _params(DECODE_TOKENS), f"d{i}") for i, p in enumerate(decodes)]
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    pending: dict[Any, tuple[Any, float]] = {}  # prefill call -> (held request, arrival)
    transfers: list[dict[str, float]] = []
    step = 0
    while core.has_work() or pending:
        if step in ARRIVALS:
            prompt = longs[ARRIVALS.index(step)]
            held = core.make_request(prompt, _params(LONG_TOKENS), f"long{step}")
            skip = reserve(core, held)
            pending[prefill.prefill.remote(prompt, skip, held.request_id)] = (held, time.perf_counter())
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in ready:
            held, arrived = pending.pop(ref)
            ticket, prefill_s = ray.get(ref)
            got = time.perf_counter()
            payload = RayObjectTransport().receive(ticket)
            received = time.perf_counter()
            adopt(core, held, payload)
            transfers.append(
                {
                    "prefill_s": prefill_s,
                    "receive_ms": 1e3 * (received - got),
                    "adopt_ms": 1e3 * (time.perf_counter() - received),
                    "t0_at_decode_ms": 1e3 * (time.perf_counter() - arrived),
                    "bytes": payload.nbytes,
                }
            )
        if not core.has_work():
            time.sleep(0.001)  # only long prompts in flight: wait for their KV
            continue
        for out in core.step():
            if out.request_id in stamps:
                stamps[out.request_id].append(time.perf_counter())
        step += 1
    ray.kill(prefill)
    return {**_itl_summary(stamps), "transfers": transfers, "decode_steps": step}


def bytes_per_request(model: Path) -> dict[str, Any]:
    from antumbra.replicas.kv_transfer.payload import row_arithmetic

    out: dict[str, Any] = {}
    for numerics in ("exact", "release"):
        engine = _engine(model, numerics)
        rows = {}
        for n in (300, LONG_PROMPT):
            prompt = torch.randint(5, 261, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            payload = engine.disaggregation.prefill_export(prompt, _params(2))
            want = row_arithmetic(engine.pools, n, 0)
            lay = engine.pools.layout
            rows[str(n)] = {
                "payload_bytes": payload.nbytes,
                "arithmetic": want,
                "equal": payload.nbytes == want["total"],
                "all_swa_rows_bytes": lay.num_layers * n * engine.pools.kv_format.row_bytes,
                "kv_row_bytes": engine.pools.kv_format.row_bytes,
                "index_row_bytes": engine.pools.index_format.row_bytes,
            }
        out[numerics] = rows
    return out


def transports(model: Path) -> dict[str, Any]:
    import datetime as dt

    import ray
    import torch.distributed as dist

    from antumbra.replicas.kv_transfer.transport import RayObjectTransport, TorchDistTransport

    engine = _engine(model)
    prompt = torch.randint(5, 261, (LONG_PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    payload = engine.disaggregation.prefill_export(prompt, _params(2))

    @ray.remote(num_cpus=0)
    def put(p: Any) -> tuple[Any, float]:
        started = time.perf_counter()
        ticket = RayObjectTransport().send(p)
        return ticket, time.perf_counter() - started

    ray_runs = []
    for _ in range(5):
        ticket, put_s = ray.get(put.remote(payload))
        started = time.perf_counter()
        RayObjectTransport().receive(ticket)
        ray_runs.append((put_s, time.perf_counter() - started))
    store = dist.HashStore()
    groups = [None, None]

    def make(r: int) -> None:
        groups[r] = dist.ProcessGroupGloo(store, r, 2, dt.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gloo_runs = []
    sender, receiver = TorchDistTransport(groups[0], 0, 1), TorchDistTransport(groups[1], 1, 0)
    for _ in range(5):
        started = time.perf_counter()
        ticket = sender.send(payload)
        receiver.receive(ticket)
        sender.wait_sent()
        gloo_runs.append(time.perf_counter() - started)
    mb = payload.nbytes / 1e6
    ray_total = statistics.median(p + g for p, g in ray_runs)
    gloo_total = statistics.median(gloo_runs)
    return {
        "payload_bytes": payload.nbytes,
        "ray_object_store": {
            "put_ms": 1e3 * statistics.median(p for p, _ in ray_runs),
            "get_ms": 1e3 * statistics.median(g for _, g in ray_runs),
            "total_ms": 1e3 * ray_total,
            "mb_per_s": mb / ray_total,
        },
        "gloo_p2p": {"total_ms": 1e3 * gloo_total, "mb_per_s": mb / gloo_total},
    }


def run(ctx: Context) -> dict[str, Any]:
    import ray

    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "load_average_at_start": os.getloadavg(),
        "workload": {
            "decodes": NUM_DECODES,
            "decode_prompt": DECODE_PROMPT,
            "decode_tokens": DECODE_TOKENS,
            "long_prompt": LONG_PROMPT,
            "long_tokens": LONG_TOKENS,
            "arrival_steps": ARRIVALS,
        },
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_tiny_checkpoint(Path(tmp) / "tiny")
            result["colocated"] = colocated(model, None)
            result["colocated_chunked_256"] = colocated(model, 256)
            result["pd"] = disaggregated(model)
            result["bytes_per_request"] = bytes_per_request(model)
            result["transports"] = transports(model)
    finally:
        ray.shutdown()
    result["load_average_at_end"] = os.getloadavg()
    co, ch, pd = result["colocated"], result["colocated_chunked_256"], result["pd"]
    result["ratios"] = {
        "itl_p99_colocated_vs_pd": co["itl_p99_ms"] / pd["itl_p99_ms"],
        "itl_p99_chunked_vs_pd": ch["itl_p99_ms"] / pd["itl_p99_ms"],
    }
    return result
