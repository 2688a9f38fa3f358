"""The import graph of `antumbra/`, read from the sources with `ast` (nothing is imported).

Every import counts, wherever it stands (inside a function, under `if TYPE_CHECKING:`): a lazy
import is still a dependency. The rules:

  1. no import cycle between modules, nor between packages (a package is a folder's modules, its
     subfolders apart; each module directly under `antumbra/` is a unit of its own, as those are
     layers of their own);
  2. layers point downward: `cli` -> `platform` -> `antumbra` (the package's public names) ->
     `replicas` -> `cachestore` -> `kernels` -> `config` / `env`; a module imports its own layer
     or lower ones;
  3. inside the platform, what `antumbra/platform/__init__.py` states: each process's subpackage
     imports the shared modules and its own code, `replica` also `routing.directory`, `control`
     nothing, `launch` any of them, and nothing imports `launch`.
  4. no module imports another module's private name (`from .x import _helper`): what two modules
     share is public, in a module both may import (kernel codecs: `kernels/common/`).

The checks at the bottom run the same functions on small made-up trees, so each rule is seen to fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SOURCE_ROOT = Path(__file__).resolve().parents[1]

# Lower layers first: an import may only go to its own layer or a lower one. A name stands for the
# module and everything under it, except "antumbra", which is only antumbra/__init__.py.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("antumbra.config", "antumbra.env"),
    ("antumbra.kernels",),
    ("antumbra.cachestore",),
    ("antumbra.replicas",),
    ("antumbra",),  # the package itself: `from antumbra import Engine, SamplingParams`
    ("antumbra.rl",),  # an RL example on the engine, beside the serving path (nothing serving imports it)
    ("antumbra.platform",),
    ("antumbra.cli",),
)

# Inside `antumbra.platform`: the parts each part may import besides itself (a part is a subpackage,
# a shared module, or one named module of a subpackage). `antumbra/platform/__init__.py` says why.
SHARED = frozenset({"messages", "redis_client", "metrics"})
PLATFORM_IMPORTS: dict[str, frozenset[str]] = {
    "": frozenset(),  # antumbra/platform/__init__.py
    "messages": frozenset(),
    "redis_client": frozenset(),
    "metrics": frozenset(),
    "ingress": SHARED,
    "routing": SHARED,
    "replica": SHARED | {"routing.directory"},
    "control": frozenset(),
    "launch": SHARED | {"ingress", "routing", "replica", "control"},
}


# ---------------------------------------------------------------------------------------------- the graph


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `root`, by dotted name (a package by its own name)."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module `name` refers to: itself, else its longest prefix that is a module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names a statement may import: `from a import b` gives `a.b` (a module or not)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base_parts = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = base_parts[: len(base_parts) - (node.level - 1)]
        base = ".".join([*base_parts, *([node.module] if node.module else [])])
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def import_graph(root: Path, package: str = "antumbra") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (anywhere in its source)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for name in _imported(node, module, path.name == "__init__.py"):
                    target = _resolve(name, modules)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def private_imports(root: Path, package: str = "antumbra") -> list[str]:
    """`module imports name` for every private name a module of `package` imports from another module."""
    modules = module_names(root, package)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = _imported(node, module, path.name == "__init__.py")
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if any(_is_private(part) for part in name.split(".")):
                    found.append(f"{module} imports {name}")
    return sorted(found)


def package_graph(
    graph: Mapping[str, Iterable[str]], packages: Iterable[str], root: str = "antumbra"
) -> dict[str, set[str]]:
    """The module graph folded into packages: a module counts as its folder's package (`packages`
    names the folders), except a module directly under `root`, which stays a unit of its own."""
    folders = set(packages)

    def unit(module: str) -> str:
        if module in folders:
            return module
        parent = module.rpartition(".")[0]
        return module if parent == root else parent

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = unit(module)
        folded.setdefault(mine, set()).update(unit(t) for t in targets if unit(t) != mine)
    return folded


def packages_of(root: Path, package: str = "antumbra") -> set[str]:
    """Dotted names of the folders (packages) under `root/package`."""
    return {name for name, path in module_names(root, package).items() if path.name == "__init__.py"}


# ---------------------------------------------------------------------------------------------- the rules


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of the longest name that covers `module`."""
    best: tuple[int, int] | None = None  # (name length, layer)
    for layer, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or ("." in prefix and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), layer)
    return best[1] if best else None


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports that go up a layer, and modules that no layer covers."""
    found = []
    for module in sorted(graph):
        mine = layer_of(module)
        if mine is None:
            found.append(f"{module}: in no layer (add it to LAYERS)")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                found.append(f"{module} imports {target}, a higher layer")
    return found


def platform_part(module: str) -> str | None:
    """`antumbra.platform.ingress.auth` -> "ingress.auth"; None outside the platform."""
    if module == "antumbra.platform":
        return ""
    prefix = "antumbra.platform."
    return module[len(prefix) :] if module.startswith(prefix) else None


def _within(name: str, part: str) -> bool:
    return name == part or name.startswith(part + ".")


def platform_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports inside the platform that `PLATFORM_IMPORTS` does not allow."""
    found = []
    for module in sorted(graph):
        name = platform_part(module)
        if name is None:
            continue
        part = name.split(".")[0]
        if part not in PLATFORM_IMPORTS:
            found.append(f"{module}: not covered by PLATFORM_IMPORTS")
            continue
        allowed = PLATFORM_IMPORTS[part] | {part}
        for target in sorted(graph[module]):
            target_name = platform_part(target)
            if target_name is None or any(_within(target_name, ok) for ok in allowed):
                continue
            found.append(f"{module} imports {target}")
    return found


# ---------------------------------------------------------------------------------------------- antumbra/


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(SOURCE_ROOT)


def test_the_graph_sees_the_platform(graph: dict[str, set[str]]) -> None:
    assert "antumbra.platform.routing.directory" in graph["antumbra.platform.routing.router"]
    assert "antumbra.platform.messages" in graph["antumbra.platform.ingress.prepare"]


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_package_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(package_graph(graph, packages_of(SOURCE_ROOT)))
    assert not found, "package cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_is_imported_across_modules() -> None:
    found = private_imports(SOURCE_ROOT)
    assert not found, "make them public, where both modules may import them:\n" + "\n".join(found)


def test_layers_point_downward(graph: dict[str, set[str]]) -> None:
    found = layer_violations(graph)
    assert not found, "\n".join(found)


def test_platform_processes_import_only_what_they_share(graph: dict[str, set[str]]) -> None:
    found = platform_violations(graph)
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------- the checks can fail


def _tree(root: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for directory in {p.parent for p in root.rglob("*.py")}:
        (directory / "__init__.py").touch()
    return import_graph(root)


def test_a_cycle_through_a_lazy_import_is_found(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "antumbra/cli.py": "def serve():\n    from antumbra.platform.launch import serve_cli\n",
            "antumbra/platform/launch/serve_cli.py": "from antumbra.cli import main\n",
        },
    )
    assert cycles(graph) == [["antumbra.cli", "antumbra.platform.launch.serve_cli"]]


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "antumbra/kernels/rope/triton.py": "from antumbra.cachestore import pools\n",
            "antumbra/cachestore/pools.py": "from antumbra.config import ModelConfig\n",
            "antumbra/config.py": "",
            "antumbra/replicas/engine.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from antumbra.platform import metrics\n"
            ),
            "antumbra/platform/metrics.py": "",
            "antumbra/utils.py": "",
        },
    )
    assert layer_violations(graph) == [
        "antumbra.kernels.rope.triton imports antumbra.cachestore.pools, a higher layer",
        "antumbra.replicas.engine imports antumbra.platform.metrics, a higher layer",
        "antumbra.utils: in no layer (add it to LAYERS)",
    ]


def test_a_crossing_between_platform_processes_is_found(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "antumbra/platform/messages.py": "",
            "antumbra/platform/ingress/prepare.py": "from ...platform.messages import GenerateRequest\n",
            "antumbra/platform/ingress/errors.py": "",
            "antumbra/platform/routing/directory.py": "",
            "antumbra/platform/routing/router.py": "from ..ingress.errors import REDIS_ERRORS\n",
            "antumbra/platform/replica/publisher.py": "from antumbra.platform.routing import directory\n",
            "antumbra/platform/replica/model_server.py": "import antumbra.platform.routing.router\n",
            "antumbra/platform/control/autoscaling.py": "from antumbra.platform import messages\n",
            "antumbra/platform/launch/app.py": "",
            "antumbra/platform/ingress/deployment.py": "from antumbra.platform.launch.app import build_app\n",
        },
    )
    assert platform_violations(graph) == [
        "antumbra.platform.control.autoscaling imports antumbra.platform.messages",
        "antumbra.platform.ingress.deployment imports antumbra.platform.launch.app",
        "antumbra.platform.replica.model_server imports antumbra.platform.routing.router",
        "antumbra.platform.routing.router imports antumbra.platform.ingress.errors",
    ]


def test_a_package_cycle_without_a_module_cycle_is_found(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "antumbra/replicas/core.py": "from .transfer import export\n",
            "antumbra/replicas/engine.py": "",
            "antumbra/replicas/transfer/export.py": "",
            "antumbra/replicas/transfer/adopt.py": "from ..engine import Engine\n",
            "antumbra/config.py": "",
            "antumbra/env.py": "from antumbra import config\n",
        },
    )
    assert cycles(graph) == []
    folded = package_graph(graph, packages_of(tmp_path))
    assert cycles(folded) == [["antumbra.replicas", "antumbra.replicas.transfer"]]
    assert folded["antumbra.env"] == {"antumbra.config"}  # modules under antumbra/ stay units


def test_a_private_import_is_found(tmp_path: Path) -> None:
    files = {
        "antumbra/kernels/codes.py": "def _pow2(k):\n    return 2**k\n",
        "antumbra/kernels/norm.py": "from .codes import _pow2\nfrom . import codes as _codes\n",
        "antumbra/kernels/rope.py": "import antumbra.kernels._impl\nfrom .codes import __doc__\n",
        "antumbra/kernels/_impl.py": "",
    }
    _tree(tmp_path, files)
    assert private_imports(tmp_path) == [
        "antumbra.kernels.norm imports antumbra.kernels.codes._pow2",
        "antumbra.kernels.rope imports antumbra.kernels._impl",
    ]
