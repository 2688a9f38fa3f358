"""The speculation threshold a spec_decode measurement supports (`speculation_threshold`)."""

from __future__ import annotations

import json

from antumbra.config import DEFAULT_SPECULATIVE_MAX_BATCH, SpeculativeConfig
from benchmarks.engine.spec_decode import speculation_threshold
from benchmarks.lib.records import RESULTS_DIR


def test_the_threshold_is_the_last_batch_of_the_run_of_speedups_from_batch_1() -> None:
    assert speculation_threshold({1: 1.9, 8: 1.2, 32: 0.8}) == 8
    assert speculation_threshold({1: 1.9, 8: 0.9, 32: 1.1}) == 1  # a later speedup does not count
    assert speculation_threshold({1: 0.3, 8: 1.6}) == 0
    assert speculation_threshold({32: 1.05, 1: 2.0, 8: 1.4}) == 32
    assert speculation_threshold({1: 0.97, 8: 0.96}, floor=0.95) == 8


def test_the_default_speculation_cap_is_the_threshold_the_gpu_benchmark_measured() -> None:
    """`SpeculativeConfig.max_batch`'s default follows the H200 run of `spec_decode` with the token
    map: the largest batch at which speculating beat plain decoding (at least 1, so that setting
    `speculative_tokens` alone speculates a lone request)."""
    section = json.loads((RESULTS_DIR / "engine.json").read_text())["sections"]["spec_decode_token_map"]
    assert "H200" in section["measured"]["device"]
    assert DEFAULT_SPECULATIVE_MAX_BATCH == max(1, section["speculative_max_batch_measured"])
    assert SpeculativeConfig(tokens=3).max_batch == DEFAULT_SPECULATIVE_MAX_BATCH
