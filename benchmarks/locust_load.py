"""Locust as a benchmark's load: `loadtest/run_headless.py` in a subprocess, and what it leaves behind.

    proc = start_locust(url, tenants, out_dir, duration_s=600, users=6)   # tenants: TenantLoad dicts
    ...                                                                     # faults, probes meanwhile
    proc.wait(); summary, report = locust_results(out_dir)

Each tenant is a `loadtest.workload.TenantLoad` mapping (`name`, `api_key`, `rps`, `weight`,
`max_tokens`, `message_words`). `out_dir` keeps Locust's CSVs (`locust_*.csv`), the locustfile's
`report.json` (per-tenant token totals from the responses' `usage`, final statistics) and
`summary.json` / `summary.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def start_locust(url: str, tenants: list[dict[str, Any]], out: Path, *, duration_s: int,
                 users: int) -> subprocess.Popen[bytes]:
    """Start the headless run (it ends by itself after `duration_s`, plus Locust's stop timeout)."""
    out.mkdir(parents=True, exist_ok=True)
    tenants_file = out / "tenants.json"
    tenants_file.write_text(json.dumps(tenants))
    tenants_file.chmod(0o600)  # it holds API keys
    command = [sys.executable, "-m", "loadtest.run_headless", "--url", url, "--tenants", f"@{tenants_file}",
               "--duration", str(duration_s), "--users", str(users), "--spawn-rate", str(users),
               "--out", str(out)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path})


def locust_results(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's summary and the locustfile's report (empty when Locust wrote none); the tenants file
    with its keys is removed."""
    (out / "tenants.json").unlink(missing_ok=True)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return summary, report
