"""Results files: one current file per suite, `benchmarks/results/<suite>.json` (history is git's).

Every file records where its figures come from: the tree's hash computed where the suite ran
(`tree_hash.py`) and, where git is there, HEAD and whether the tree matched it; the device, the
versions and the date. A run of part of a suite (`--only`) keeps the other sections of the current
file when that file holds figures of the same tree, and starts the file afresh otherwise, so one
file never mixes two trees' figures.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import platform
from pathlib import Path
from typing import Any

import torch

from .tree_hash import ROOT, folder_hashes, git_state, tree_hash

RESULTS_DIR = ROOT / "benchmarks" / "results"
SMOKE_DIR = RESULTS_DIR / "smoke"  # git-ignored: a smoke run checks the code, its figures mean nothing


def write_results(filename: str, result: dict[str, Any]) -> Path:
    """A standalone benchmark's results as `RESULTS_DIR / filename`; prints its ratios and the path."""
    path = RESULTS_DIR / filename
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))
    print(f"wrote {path}")
    return path


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    return "cpu: " + platform.processor()


def provenance(device: str) -> dict[str, Any]:
    """Where figures come from: the tree, the device, the versions, the time."""
    info: dict[str, Any] = {
        "tree": tree_hash(),
        "folders": folder_hashes(),
        "git": git_state(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "num_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
    for package in ("transformers", "triton", "ray"):
        with contextlib.suppress(ImportError):  # absent on some machines: recorded when present
            info[package] = importlib.import_module(package).__version__
    return info


class ResultsFile:
    """`<dir>/<suite>.json`: provenance, one section per benchmark, `ratios` and `targets`."""

    def __init__(self, suite: str, device: str, smoke: bool, directory: Path | None = None) -> None:
        self.path = (directory or (SMOKE_DIR if smoke else RESULTS_DIR)) / f"{suite}.json"
        fresh = {"suite": suite, "smoke": smoke, **provenance(device), "sections": {}, "ratios": {}}
        kept = json.loads(self.path.read_text()) if self.path.exists() else {}
        same_tree = kept.get("tree") == fresh["tree"] and kept.get("device") == fresh["device"]
        self.data: dict[str, Any] = {**fresh, "sections": kept.get("sections", {}),
                                     "ratios": kept.get("ratios", {})} if same_tree else fresh

    def put(self, name: str, section: dict[str, Any], ratios: dict[str, float]) -> None:
        """Record one benchmark's section and its headline ratios, and write the file."""
        self.data["sections"][name] = section
        self.data["ratios"].update(ratios)
        self.save()

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        return self.path
