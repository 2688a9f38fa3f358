"""The replica's classes compose their parts, read from the sources with `ast` (nothing is imported).

A feature the engine serves beside plain generation (RL training, prefill / decode handoff) is an
object built over the collaborators it needs (`engine.training`, `engine.disaggregation`), not a
base class that reaches into members its subclass happens to define. The rule, for every class
under `antumbra/replicas/`: at most one base class, and none named as a mixin (`...API`, `...Mixin`).

The check at the bottom runs the same function on a small made-up tree, so the rule is seen to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]
MIXIN_SUFFIXES = ("API", "Mixin")


def _base_name(base: ast.expr) -> str:
    """`Base`, `module.Base` or `Base[T]` -> "Base"."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return ast.unparse(base)


def mixed_in_classes(root: Path, package: str = "antumbra/replicas") -> list[str]:
    """`path: Class(bases)` for every class under `root/package` with several bases or a mixin base."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            names = [_base_name(b) for b in node.bases]
            if len(names) > 1 or any(n.endswith(MIXIN_SUFFIXES) for n in names):
                found.append(f"{path.relative_to(root).as_posix()}: {node.name}({', '.join(names)})")
    return found


def test_no_replica_class_inherits_a_mixin() -> None:
    found = mixed_in_classes(SOURCE_ROOT)
    assert not found, "compose these parts (pass their collaborators in) instead:\n" + "\n".join(found)


def test_the_engine_has_no_base_class() -> None:
    source = (SOURCE_ROOT / "antumbra/replicas/engine/engine.py").read_text()
    classes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    engine = next(n for n in classes if n.name == "Engine")
    assert engine.bases == []


def test_a_mixin_or_a_second_base_is_found(tmp_path: Path) -> None:
    files = {
        "antumbra/replicas/engine.py": (
            "from .training import TrainingAPI\n"
            "class Engine(TrainingAPI):\n    pass\n"
            "class Both(Base, Other):\n    pass\n"
            "class Typed(mod.CacheMixin[int]):\n    pass\n"
            "class Plain(abc.ABC):\n    pass\n"
        ),
        "antumbra/replicas/training.py": "class TrainingAPI:\n    pass\n",
        "antumbra/platform/server.py": "class Server(A, B):\n    pass\n",  # outside replicas/
    }
    for name, source in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    assert mixed_in_classes(tmp_path) == [
        "antumbra/replicas/engine.py: Engine(TrainingAPI)",
        "antumbra/replicas/engine.py: Both(Base, Other)",
        "antumbra/replicas/engine.py: Typed(CacheMixin)",
    ]
