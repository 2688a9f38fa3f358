"""What a benchmark results file records: the tree's hash as git computes it, and one tree's figures only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks.lib import tree_hash
from benchmarks.lib.records import ResultsFile


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_a_folders_hash_is_gits_tree_id(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "pkg" / "sub-file").write_text("sorted after the folder `sub` by git's rule\n")
    (tmp_path / "pkg" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "pkg" / "run.sh", 0o755)
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")  # ignored, as git does
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "pkg")
    want = _git(tmp_path, "rev-parse", _git(tmp_path, "write-tree") + ":pkg")
    assert tree_hash.folder_hashes(tmp_path, ("pkg",)) == {"pkg": want}


def test_this_trees_folders_match_head_where_they_are_unchanged() -> None:
    root = tree_hash.ROOT
    if not _git(root, "status", "--porcelain", "--untracked-files=all", "--", "antumbra"):
        assert tree_hash.folder_hashes()["antumbra"] == _git(root, "rev-parse", "HEAD:antumbra")
    changes = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *tree_hash.HASHED,
                   ":!benchmarks/results")
    assert tree_hash.git_state()["clean"] == (changes == "")


def test_a_results_file_holds_one_trees_figures(tmp_path: Path) -> None:
    first = ResultsFile("suite", "cpu", smoke=True, directory=tmp_path)
    first.put("one", {"x": 1}, {"one_ratio": 2.0})
    again = ResultsFile("suite", "cpu", smoke=True, directory=tmp_path)
    again.put("two", {"y": 1}, {})
    data = json.loads((tmp_path / "suite.json").read_text())
    assert set(data["sections"]) == {"one", "two"} and data["ratios"] == {"one_ratio": 2.0}
    assert data["tree"] == tree_hash.tree_hash() and data["device"].startswith("cpu")
    data["tree"] = "0" * 40  # as if another tree had written it
    (tmp_path / "suite.json").write_text(json.dumps(data))
    other = ResultsFile("suite", "cpu", smoke=True, directory=tmp_path)
    other.put("three", {}, {})
    assert set(json.loads((tmp_path / "suite.json").read_text())["sections"]) == {"three"}
