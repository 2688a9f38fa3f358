"""benchmarks/README.md's CPU block runs as written, and each run records where its figures come from.

The block after "## On a CPU" is run line by line (`python` is this interpreter); every `run` line must
exit 0 and leave `benchmarks/results/smoke/<suite>.json` with the tree's hash, the benchmarks it asked
for and no error in any of them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "benchmarks" / "README.md"


def cpu_commands(text: str) -> list[list[str]]:
    """The command lines of the first ```sh block after the "## On a CPU" heading."""
    section = text.split("\n## On a CPU\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_has_a_cpu_block_of_smoke_runs() -> None:
    commands = cpu_commands(README.read_text())
    runs = [c for c in commands if c[:4] == ["python", "-m", "benchmarks", "run"]]
    assert runs and all("--smoke" in c for c in runs)
    assert {c[4] for c in runs} >= {"kernels", "engine", "cache", "platform", "gpu-tests"}


@pytest.mark.parametrize("command", cpu_commands(README.read_text()), ids=" ".join)
def test_each_cpu_command_runs_as_written(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if command[3] != "run":
        return
    suite = command[4]
    results = json.loads((ROOT / "benchmarks" / "results" / "smoke" / f"{suite}.json").read_text())
    from benchmarks.lib.tree_hash import tree_hash

    assert results["tree"] == tree_hash() and results["smoke"] is True
    assert results["device"].startswith("cpu")
    asked = command[command.index("--only") + 1].split(",") if "--only" in command else None
    sections = results["sections"]
    assert asked is None or set(asked) <= set(sections)
    assert not [name for name, section in sections.items() if "error" in section]
