"""No module of `antumbra/` outside `kernels/` grows past `MAX_LINES` lines.

A file that long mixes concerns (the ones that grew past it were split: request vs response bodies,
checkpoint names vs plan vs reading, ...). Kernels are exempt: a Triton kernel, its launch
configurations and its host wrapper read best in one file.
"""

from __future__ import annotations

from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
EXEMPT = ("antumbra/kernels/",)


def oversized(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """`path: N lines` for every `.py` under `root/antumbra` over `max_lines`, exempt folders aside."""
    found = []
    for path in sorted((root / "antumbra").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(EXEMPT):
            continue
        lines = len(path.read_text().splitlines())
        if lines > max_lines:
            found.append(f"{name}: {lines} lines")
    return found


def test_no_module_outside_kernels_exceeds_the_limit() -> None:
    found = oversized(SOURCE_ROOT)
    assert not found, f"split these by concern (limit {MAX_LINES} lines):\n" + "\n".join(found)


def test_an_oversized_module_is_found_and_kernels_are_exempt(tmp_path: Path) -> None:
    for name, lines in (
        ("antumbra/replicas/big.py", MAX_LINES + 1),
        ("antumbra/replicas/at_limit.py", MAX_LINES),
        ("antumbra/kernels/attention/triton.py", MAX_LINES + 50),
    ):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)
    assert oversized(tmp_path) == [f"antumbra/replicas/big.py: {MAX_LINES + 1} lines"]
