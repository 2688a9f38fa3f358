"""Shared helpers for benchmarks: environment facts recorded beside every figure."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
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
