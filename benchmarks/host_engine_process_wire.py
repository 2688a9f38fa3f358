"""What the engine process's other threads cost per step and per flush, on the CPU.

    python -m benchmarks.host_engine_process_wire [--streams 32] [--reps 2000] [--flushes 300]

An engine process (`antumbra/platform/replica/engine_child.py`) runs the engine's stepping thread
beside threads that share its interpreter lock: the output thread makes one `OutputDelta` per
request and step, the sender pickles a step's deltas into one message (which the replica reads
back), and the prefix directory's publisher flushes cache events into Redis. Timed here:

  * one step's deltas for `--streams` requests of one new token each, made, pickled and read back,
    median over 7 rounds of `--reps`: `OutputDelta` (a named tuple) against a frozen dataclass of
    the same fields (what it was);
  * one publisher flush (`Publisher.flush_once`) carrying 1, 7, 37 and 150 block events, the
    flushing thread's CPU time, against a redis-server this benchmark starts on a free port.

Ratio: `delta_tuple_vs_dataclass_s{streams}`. Writes benchmarks/results/host-engine-process-wire.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import pickle
import random
import statistics
import time
from types import SimpleNamespace
from typing import Any

from antumbra.platform.replica.engine_wire import OutputDelta

from .lib.records import provenance, write_results

ROUNDS = 7
EVENTS_PER_FLUSH = (1, 7, 37, 150)


def _as_frozen_dataclass(named: Any) -> type:
    """A named tuple's fields as a frozen dataclass of this module (so pickle finds it)."""
    fields = [(name, Any, dataclasses.field(default=named._field_defaults[name]))
              if name in named._field_defaults else (name, Any) for name in named._fields]
    made = dataclasses.make_dataclass(f"Dataclass{named.__name__}", fields, frozen=True)
    made.__module__ = __name__
    return made


# `OutputDelta` as a frozen dataclass (what it was): the peer.
DataclassOutputDelta = _as_frozen_dataclass(OutputDelta)


def standalone_publisher(url: str, replica_id: str, **options: Any) -> Any:
    """A `Publisher` into the Redis at `url` for an engine with nothing cached (no engine: its
    snapshot is empty, its events come from the caller's `on_event`)."""
    from antumbra.platform.redis_client import redis_client
    from antumbra.platform.replica.publisher import Publisher

    engine = SimpleNamespace(pools=None, cached_block_hashes=lambda: [])
    return Publisher(engine, replica_id, "bench-model", functools.partial(redis_client, url), **options)


def _step_us(kind: Any, streams: int, reps: int) -> float:
    """us for one step's deltas: made, pickled as one message, read back (median of the rounds)."""
    rids = [f"cmpl-{i:032x}" for i in range(streams)]

    def step(n: int) -> None:
        batch = [(rid, kind([n], "", None, n, 0, None, None, "v0", 0, 0)) for rid in rids]
        pickle.loads(pickle.dumps(("outputs", batch), protocol=pickle.HIGHEST_PROTOCOL))

    rounds = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for n in range(reps):
            step(n)
        rounds.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(rounds)


def measure_deltas(streams: int, reps: int) -> dict[str, float]:
    return {"named_tuple_us": _step_us(OutputDelta, streams, reps),
            "frozen_dataclass_us": _step_us(DataclassOutputDelta, streams, reps)}


def measure_flushes(flushes: int) -> dict[str, dict[str, float]]:
    """CPU and wall ms per publisher flush by events carried, against a fresh redis-server."""
    from antumbra.cachestore.block_hash import BlockStored
    from antumbra.platform.launch.redis_server import LocalRedis

    rng = random.Random(0)
    out: dict[str, dict[str, float]] = {}
    with LocalRedis() as server:
        publisher = standalone_publisher(server.url, "bench-replica")
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(publisher.flush_once())  # the first batch: a snapshot
            for events in EVENTS_PER_FLUSH:
                cpu_s = wall_s = 0.0
                for _ in range(flushes):
                    for _ in range(events):
                        publisher.on_event(0, BlockStored((rng.getrandbits(63),), "device"))
                    cpu0, wall0 = time.thread_time(), time.perf_counter()
                    assert loop.run_until_complete(publisher.flush_once())
                    cpu_s += time.thread_time() - cpu0
                    wall_s += time.perf_counter() - wall0
                out[str(events)] = {"cpu_ms": cpu_s / flushes * 1e3, "wall_ms": wall_s / flushes * 1e3}
        finally:
            loop.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--flushes", type=int, default=300)
    args = parser.parse_args()
    deltas = measure_deltas(args.streams, args.reps)
    result = {**provenance("cpu"), "streams": args.streams, "reps": args.reps, "deltas": deltas,
              "flushes": args.flushes, "flush_by_events": measure_flushes(args.flushes),
              "ratios": {f"delta_tuple_vs_dataclass_s{args.streams}":
                         deltas["named_tuple_us"] / deltas["frozen_dataclass_us"]}}
    write_results("host-engine-process-wire.json", result)


if __name__ == "__main__":
    main()
