"""Plugins: modules named by `ANTUMBRA_PLUGINS` that the process imports before its first engine runs.

An entry `module` or `module:argument` imports the module and calls its `install(argument)` once per
process (the argument is "" without one). A plugin changes the engine only through what Python lets
it patch; the engine knows no plugin by name. The entry point for what a deployment adds to every
replica process without a change to the product, as vLLM's general plugins are (the fault tests
install their fault injection this way: `tests/faults/injection.py`).
"""

from __future__ import annotations

import importlib
import threading

from antumbra import env

_loaded: set[str] = set()
_lock = threading.Lock()


def load_plugins() -> tuple[str, ...]:
    """Install every plugin `env.plugins()` names that this process has not installed yet; -> the
    entries installed so far."""
    with _lock:
        for entry in env.plugins():
            if entry in _loaded:
                continue
            module_name, _, argument = entry.partition(":")
            importlib.import_module(module_name).install(argument)
            _loaded.add(entry)
        return tuple(sorted(_loaded))
