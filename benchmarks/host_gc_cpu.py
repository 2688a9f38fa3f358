"""The pause a full garbage collection puts into a replica process, before and after the replica
freezes its start-up heap (`antumbra/platform/replica/heap.py`), on the CPU.

    python -m benchmarks.host_gc_cpu [--reps 5]

The process imports what a deployed replica's does (torch, Ray, Ray Serve, the platform) and builds
a `ModelServer` around the tiny checkpoint (its engine warmed by one request), without freezing.
Measured: the objects the collector tracks and the wall time of a full collection (`gc.collect()`,
min and max over `--reps`), then the same after `freeze_startup_heap`. A collection holds the GIL,
so its pause is a pause of the engine's stepping thread. Writes benchmarks/results/host-gc.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from .lib.records import RESULTS_DIR, provenance


def _collections_ms(reps: int) -> dict[str, float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return {"min_ms": min(times), "max_ms": max(times)}


def _heap(reps: int) -> dict[str, Any]:
    return {"tracked_objects": len(gc.get_objects()), "full_collection": _collections_ms(reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import ray  # noqa: F401  (a replica process has them imported)
    from ray import serve  # noqa: F401

    from antumbra.config import SchedulerConfig
    from antumbra.platform.messages import GenerateRequest
    from antumbra.platform.replica.heap import freeze_startup_heap
    from antumbra.platform.replica.model_server import ModelServer
    from antumbra.replicas.model.tiny import make_tiny_checkpoint
    from antumbra.replicas.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny")
        settings = {"scheduler": SchedulerConfig(max_model_len=512)}
        server = ModelServer("tiny", str(path), engine_kwargs=settings)

        async def one() -> list[Any]:
            request = GenerateRequest("warm", list(range(3, 40)), SamplingParams(max_tokens=4), "tiny:gc")
            return [item async for item in server.generate(request)]

        warm = asyncio.run(one())
        assert warm and warm[-1].get("finish_reason") == "length", warm[-1:]
        before = _heap(args.reps)
        frozen = freeze_startup_heap()
        after = _heap(args.reps)
    result = {**provenance("cpu"), "reps": args.reps, "before_freeze": before, "frozen_objects": frozen,
              "after_freeze": after,
              "full_collection_before_vs_after": before["full_collection"]["min_ms"]
              / max(after["full_collection"]["min_ms"], 1e-6)}
    out = RESULTS_DIR / "host-gc.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("before_freeze", "frozen_objects", "after_freeze")}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
