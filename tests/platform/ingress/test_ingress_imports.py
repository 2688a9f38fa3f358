"""The ingress process never runs a model: importing what it runs must not load torch or Triton.

Each check imports in a fresh interpreter (this test process has torch loaded already) and lists
the heavy modules that came in.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton")
PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def heavy_modules_after_importing(module: str) -> list[str]:
    code = PROBE.format(module=module, heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module",
    [
        "antumbra.platform.ingress.deployment",  # the ingress deployment, as Ray Serve imports it
        "antumbra.env",  # `from antumbra import env` loads no engine
    ],
)
def test_the_ingress_process_imports_no_torch(module: str) -> None:
    assert heavy_modules_after_importing(module) == []


def test_the_probe_sees_torch_where_it_is_imported() -> None:
    assert heavy_modules_after_importing("antumbra.replicas.sampler") == ["torch", "triton"]


def test_the_public_names_still_load_on_use() -> None:
    import antumbra

    assert antumbra.SamplingParams(max_tokens=3).max_tokens == 3
    assert "Engine" in dir(antumbra)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        antumbra.Nope  # noqa: B018
