"""Shared helpers for benchmarks: environment facts recorded beside every figure."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """The commit the benchmarked code is at: `git rev-parse HEAD` (with "-dirty" when the tree has
    changes), or `$ANTUMBRA_COMMIT` where the tree travelled without its .git (the GPU machine)."""
    from antumbra import env

    given = env.benchmark_commit()
    if given:
        return given
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": _device_name(),
        "num_threads": torch.get_num_threads(),
    }
    for package in ("transformers", "triton"):
        with contextlib.suppress(ImportError):  # absent on some machines: recorded when present
            info[package] = importlib.import_module(package).__version__
    return info


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    return "cpu: " + platform.processor()


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{datetime.date.today().isoformat()}-{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


class CommitMismatch(RuntimeError):
    """Figures of two commits were about to be merged into one results file."""


def merge_result(path: Path, payload: dict[str, Any], section: str) -> dict[str, Any]:
    """Put `payload` under `section` of the results file at `path`, which must hold figures of the
    same commit (or none): a file of another commit is refused, never mixed."""
    daily: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    commit = payload.get("commit")
    if daily.get("commit") not in (None, commit):
        raise CommitMismatch(f"{path} holds figures of commit {daily['commit']}, these are of {commit}")
    daily.update({k: payload[k] for k in ("commit", "date", "device", "torch") if k in payload})
    daily[section] = payload
    path.write_text(json.dumps(daily, indent=2) + "\n")
    return daily


def standalone_main(
    name: str,
    run: Any,
    report: Callable[[dict[str, Any]], list[str]] | None = None,
    summary_keys: tuple[str, ...] = ("all_checks_ok",),
) -> None:
    """Command line of one kernel benchmark module: `[--device D] [--smoke]`, on the GPU when there
    is one (else the Triton interpreter), results to `<date>-<name>[-smoke].json`; prints the
    module's `report` lines, then `summary_keys` of the result and the file written."""
    import argparse
    import os

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs in the interpreter on CPU")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # in effect only where triton is not imported yet
    result = run(args.device, smoke=args.smoke)
    path = write_result(f"{name}{'-smoke' if args.smoke else ''}", result)
    for line in report(result) if report else []:
        print(line)
    print(json.dumps({k: result.get(k) for k in summary_keys}), "->", path)
