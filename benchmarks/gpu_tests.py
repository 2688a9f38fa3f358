"""The GPU-marked tests (`@pytest.mark.gpu`, skipped only where there is no CUDA device), run as the
`gpu-tests` suite so that their outcomes land in a results file with the tree's hash and the device,
like any figure. On a CPU (`--smoke`) they are collected and skipped: that checks the suite runs.

    python -m benchmarks run gpu-tests
    python -m benchmarks run gpu-tests --set files=moe_router,gpu_paths   # the files named so
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .lib.context import Context
from .lib.tree_hash import ROOT


def gpu_test_files() -> list[str]:
    """Test files that hold a GPU-marked test (collecting only those keeps the run short)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text())


def run(ctx: Context) -> dict[str, Any]:
    """`--set files=a,b`: only the GPU test files whose path contains one of these (default: all)."""
    wanted = [w for w in ctx.option("files", "").split(",") if w]
    files = [f for f in gpu_test_files() if not wanted or any(w in f for w in wanted)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "benchmarks.lib.pytest_outcomes",
             "--outcomes-json", str(out), "-p", "no:cacheprovider", *files],
            cwd=ROOT, capture_output=True, text=True, check=False)
        failed_to_run = {"error": proc.stdout[-3000:] + proc.stderr[-3000:]}
        outcomes = json.loads(out.read_text()) if out.exists() else failed_to_run
    counts = outcomes.get("counts", {})
    outcomes["all_passed"] = proc.returncode == 0 and not counts.get("failed") and not counts.get("error")
    outcomes["files"] = files
    return outcomes
