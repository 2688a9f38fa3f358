"""A section measured in another run (another device call, another tree) merged into a suite's
results file, which `ResultsFile` starts afresh whenever the tree changes.

The section keeps the provenance of the run that measured it under `measured` (tree hash, folder
hashes, date, device, versions), unless it carries its own already; its ratios may be renamed with
a suffix (a variant of a section already there) and, when they are the file's current headline
figures, copied into the file's `ratios`, whose `targets` table is then recomputed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .targets import summarize

# A results file is {suite, smoke, **records.provenance(...), sections, ratios, targets[, note]}.
NOT_PROVENANCE = frozenset({"suite", "smoke", "sections", "ratios", "targets", "note"})


def merge_section(target: dict[str, Any], source: dict[str, Any], section: str, name: str | None = None,
                  suffix: str = "", headline: bool = False) -> dict[str, Any]:
    """Copy source's `section` into target as `name` (default: the same); -> the section as merged."""
    if section not in source.get("sections", {}):
        raise KeyError(f"no section {section!r} in the source; it has {sorted(source.get('sections', {}))}")
    merged = copy.deepcopy(source["sections"][section])
    merged.setdefault("measured", {k: v for k, v in source.items() if k not in NOT_PROVENANCE})
    for field in ("ratios", "ratios_unchecked"):
        if suffix and isinstance(merged.get(field), dict):
            merged[field] = {key + suffix: value for key, value in merged[field].items()}
    target.setdefault("sections", {})[name or section] = merged
    ratios = target.setdefault("ratios", {})
    if headline:
        ratios.update(merged.get("ratios", {}))
    target["targets"] = summarize(ratios)
    return merged


def read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def write(path: Path, data: dict[str, Any]) -> None:
    """As `ResultsFile.save` writes it."""
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
