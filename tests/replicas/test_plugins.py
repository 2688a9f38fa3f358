"""Plugins (`ANTUMBRA_PLUGINS`): the engine installs each named one once per process before it runs,
and the product imports no test code (the fault tests inject their faults this way)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from antumbra import Engine
from antumbra.replicas import plugins
from tests.replicas import plugin_probe

SOURCE_ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_installs_each_named_plugin_once(tiny_checkpoint: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTUMBRA_PLUGINS", "tests.replicas.plugin_probe:first, tests.replicas.plugin_probe")
    monkeypatch.setattr(plugins, "_loaded", set())
    monkeypatch.setattr(plugin_probe, "installed", [])
    Engine.from_pretrained(tiny_checkpoint)
    assert plugin_probe.installed == ["first", ""]
    Engine.from_pretrained(tiny_checkpoint)
    assert plugin_probe.installed == ["first", ""]


def test_a_plugin_that_cannot_be_imported_stops_the_engine_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTUMBRA_PLUGINS", "tests.replicas.no_such_plugin")
    monkeypatch.setattr(plugins, "_loaded", set())
    with pytest.raises(ModuleNotFoundError, match="no_such_plugin"):
        plugins.load_plugins()


def test_the_product_imports_no_test_code() -> None:
    found = []
    for path in sorted((SOURCE_ROOT / "antumbra").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(SOURCE_ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not found
