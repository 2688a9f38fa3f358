"""`benchmarks/directory_scale.py --smoke`: the whole benchmark at one small replica count, seconds in
all, against real redis-servers (one, then three shards), with figures that have to make sense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.directory_scale import main


@pytest.mark.parametrize("shards", [1, 3])
def test_smoke_run_measures_every_figure(tmp_path: Path, shards: int) -> None:
    out = tmp_path / "directory_scale.json"
    assert main(["--smoke", "--shards", str(shards), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"date", "commit", "tree", "device", "redis_server", "trace", "settings"} <= set(result)
    (row,) = result["runs"]
    assert row["shards"] == shards
    # The affinity router finds more of the shared prefixes cached than two random choices.
    assert row["hit_ratio"]["affinity"] > row["hit_ratio"]["pow2"] > 0
    load = row["load"]
    assert load["decisions"] > 10 and load["lookup_fallbacks"] == 0
    assert load["decision_ms"]["p50"] > 0 and load["decision_ms"]["p99"] >= load["decision_ms"]["p50"]
    assert len(load["redis_core_share"]) == len(load["redis_used_memory_mb"]) == shards
    assert all(m > 0 for m in load["redis_used_memory_mb"])
    assert load["publisher_batches_per_s"] > 0 and load["event_lag_ms"]["p50"] > 0
    assert row["redis_us_per_lookup"] > 0
