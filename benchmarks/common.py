"""Shared helpers for benchmarks: environment facts recorded beside every figure."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import platform
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


def standalone_main(name: str, run: Any) -> None:
    """Command line of one kernel benchmark module: `[--smoke]`, on the GPU when there is one
    (else the Triton interpreter), results to `<date>-<name>[-smoke].json`."""
    import argparse
    import os

    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    result = {**environment(), **run(device, smoke=args.smoke)}
    write_result(f"{name}{'-smoke' if args.smoke else ''}", result)
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))
