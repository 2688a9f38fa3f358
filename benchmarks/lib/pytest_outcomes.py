"""A pytest plugin (`-p benchmarks.lib.pytest_outcomes --outcomes-json PATH`): each test's outcome and
duration, written as JSON when the session ends, so a suite can record a test run beside its figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes-json", default=None, help="write each test's outcome to this file")


class _Outcomes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test's outcome is its call phase's, unless setup or teardown failed or it was skipped.
        row = self.tests.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
        row["duration_s"] += report.duration
        if report.failed:
            row["outcome"] = "failed" if report.when == "call" else "error"
            row["message"] = str(report.longrepr)[-2000:]
        elif report.skipped:
            row["outcome"] = "skipped"
            row["message"] = str(report.longrepr)[-300:]

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        counts: dict[str, int] = {}
        for row in self.tests.values():
            counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
        self.path.write_text(json.dumps({"exit_status": int(exitstatus), "counts": counts,
                                         "tests": self.tests}, indent=1))


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--outcomes-json")
    if path:
        config.pluginmanager.register(_Outcomes(Path(path)), "antumbra-outcomes")
