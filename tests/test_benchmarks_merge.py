"""`python -m benchmarks merge`: a section from another run lands in a results file with that run's
provenance, renamed ratios where asked, and the targets table follows the headline ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main
from benchmarks.lib.targets import TARGETS

KEY = "decode_vs_floor_real_moe_B1"


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def source_run(tree: str, value: float) -> dict:
    section = {"ratios": {KEY: value}, "decode": {"B1": {"step_ms": 1.4}}}
    return {"suite": "engine", "tree": tree, "date": "2026-12-05T04:00:00+00:00", "device": "NVIDIA H200",
            "torch": "2.11.0", "sections": {"real_moe": section}, "ratios": {KEY: value}}


def test_a_section_keeps_its_runs_provenance_and_may_become_the_headline(tmp_path: Path) -> None:
    assert KEY in TARGETS
    target = write(tmp_path / "engine.json", {"suite": "engine", "tree": "t0", "note": "Older sections.",
                                               "sections": {"cold_start": {"first_start_s": 150.0}},
                                               "ratios": {KEY: 0.3}})
    source = write(tmp_path / "run.json", source_run("t1", 0.65))
    assert main(["merge", str(source), "real_moe", "--into", str(target), "--headline",
                 "--note", "real_moe is tree t1."]) == 0
    data = json.loads(target.read_text())
    assert target.read_text().endswith("}\n") and target.read_text().startswith('{\n  "suite"')
    assert data["sections"]["cold_start"] == {"first_start_s": 150.0}  # the others stay
    merged = data["sections"]["real_moe"]
    assert merged["measured"]["tree"] == "t1" and merged["measured"]["device"] == "NVIDIA H200"
    assert merged["decode"] == {"B1": {"step_ms": 1.4}}
    assert data["ratios"][KEY] == 0.65 and data["targets"][KEY]["met"]
    assert data["note"] == "Older sections. real_moe is tree t1."


def test_a_variant_gets_its_own_name_and_ratio_names_and_leaves_the_headline(tmp_path: Path) -> None:
    target = write(tmp_path / "engine.json", {"suite": "engine", "sections": {}, "ratios": {KEY: 0.3}})
    source = write(tmp_path / "run.json", source_run("t2", 0.5))
    assert main(["merge", str(source), "real_moe", "--into", str(target), "--as", "real_moe_rows",
                 "--suffix", "_rows"]) == 0
    data = json.loads(target.read_text())
    assert data["sections"]["real_moe_rows"]["ratios"] == {KEY + "_rows": 0.5}
    assert data["ratios"] == {KEY: 0.3} and not data["targets"][KEY]["met"]


def test_a_missing_section_is_named(tmp_path: Path) -> None:
    target = write(tmp_path / "engine.json", {"suite": "engine", "sections": {}, "ratios": {}})
    source = write(tmp_path / "run.json", source_run("t3", 0.5))
    with pytest.raises(KeyError, match="no section 'spec_decode'.*real_moe"):
        main(["merge", str(source), "spec_decode", "--into", str(target)])
    assert json.loads(target.read_text()) == {"suite": "engine", "sections": {}, "ratios": {}}
