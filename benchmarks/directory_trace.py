"""The block-event trace the directory-at-scale benchmark replays: recorded from the real engine.

`python -m benchmarks.directory_trace` runs the tiny checkpoint's engine on the CPU under a
saturating load of shared-prefix prompts (waves of concurrent requests whose prefixes are drawn
Zipf-like from a small set, each with its own tail), with a KV capacity small enough that the
cache evicts, and records every cache event the engine publishes (time, kind, hashes) plus the
blocks cached after each wave. It writes `benchmarks/data/directory_trace.json`, which
`directory_scale.py` reads for each simulated replica's event rates, event sizes and block-set size.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_PATH = Path(__file__).resolve().parent / "data" / "directory_trace.json"


@dataclass(frozen=True)
class Trace:
    """What a simulated replica needs from the recorded engine."""

    duration_s: float
    page_size: int
    capacity_blocks: int  # the engine's KV capacity in blocks (pages)
    requests: int
    events: list[tuple[float, str, int]]  # (seconds from start, "stored" / "removed" / "cleared", hashes)
    cached_blocks: list[int]  # blocks in the engine's tree after each wave
    blocks_per_request: float  # full blocks of a prompt, on average

    @classmethod
    def load(cls, path: Path = TRACE_PATH) -> Trace:
        data = json.loads(path.read_text())
        return cls(
            data["duration_s"],
            data["page_size"],
            data["capacity_blocks"],
            data["requests"],
            [tuple(e) for e in data["events"]],
            data["cached_blocks"],  # type: ignore[misc]
            data["blocks_per_request"],
        )

    @property
    def request_rate(self) -> float:
        """Requests per second one replica served under load."""
        return self.requests / self.duration_s

    @property
    def block_set_blocks(self) -> int:
        """Blocks a replica holds in the directory at steady state (the most cached after a wave)."""
        return max(self.cached_blocks)

    def rate(self, kind: str) -> float:
        return sum(1 for _, k, _ in self.events if k == kind) / self.duration_s

    def mean_hashes(self, kind: str) -> float:
        sizes = [n for _, k, n in self.events if k == kind]
        return sum(sizes) / len(sizes) if sizes else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "duration_s": round(self.duration_s, 2),
            "requests_per_s": round(self.request_rate, 2),
            "stored_events_per_s": round(self.rate("stored"), 2),
            "removed_events_per_s": round(self.rate("removed"), 2),
            "hashes_per_stored_event": round(self.mean_hashes("stored"), 2),
            "hashes_per_removed_event": round(self.mean_hashes("removed"), 2),
            "block_set_blocks": self.block_set_blocks,
            "capacity_blocks": self.capacity_blocks,
            "blocks_per_request": round(self.blocks_per_request, 2),
        }


def record(
    path: Path = TRACE_PATH,
    *,
    waves: int = 6,
    per_wave: int = 12,
    prefixes: int = 8,
    prefix_pages: tuple[int, int] = (2, 5),
    capacity_pages: int = 64,
    seed: int = 0,
) -> Trace:
    from antumbra import Engine, SamplingParams
    from antumbra.cachestore.block_hash import AllCleared, BlockEvent, BlockStored
    from antumbra.config import CacheConfig, ModelConfig
    from antumbra.replicas.model.checkpoint_files import load_hf_config
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        page = ModelConfig.from_hf(load_hf_config(checkpoint)).page_size
        engine = Engine.from_pretrained(
            str(checkpoint),
            device="cpu",
            dtype="float32",
            cache=CacheConfig(num_virtual_tokens=capacity_pages * page),
        )
        events: list[tuple[float, str, int]] = []
        lock = threading.Lock()
        start = time.monotonic()

        def on_event(_seq: int, event: BlockEvent) -> None:
            kind = (
                "cleared"
                if isinstance(event, AllCleared)
                else ("stored" if isinstance(event, BlockStored) else "removed")
            )
            with lock:
                events.append((round(time.monotonic() - start, 4), kind, len(getattr(event, "hashes", ()))))

        engine.subscribe(on_event)
        shared = [
            [rng.randrange(10, 500) for _ in range(page * rng.randint(*prefix_pages))]
            for _ in range(prefixes)
        ]
        weights = [1.0 / (i + 1) for i in range(prefixes)]
        cached, requests, blocks = [], 0, 0
        params = SamplingParams(max_tokens=8, temperature=0.0)
        start = time.monotonic()
        for _ in range(waves):
            prompts = [
                rng.choices(shared, weights)[0] + [rng.randrange(10, 500) for _ in range(page + 17)]
                for _ in range(per_wave)
            ]
            engine.generate(prompts, params)
            requests += len(prompts)
            blocks += sum(len(p) // page for p in prompts)
            cached.append(len(engine.cached_block_hashes()))
        duration = time.monotonic() - start
        engine.shutdown()
    trace = Trace(duration, page, capacity_pages, requests, events, cached, blocks / requests)
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "source": "python -m benchmarks.directory_trace: the tiny checkpoint's engine on the CPU",
        "duration_s": duration,
        "page_size": page,
        "capacity_blocks": capacity_pages,
        "requests": requests,
        "blocks_per_request": blocks / requests,
        "summary": trace.summary(),
        "cached_blocks": cached,
        "events": events,
    }
    path.write_text(json.dumps(data) + "\n")
    return trace


if __name__ == "__main__":
    recorded = record(Path(sys.argv[1]) if len(sys.argv) > 1 else TRACE_PATH)
    print(json.dumps(recorded.summary()))
