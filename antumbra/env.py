"""The one place that reads environment variables.

Everything else asks these accessors, so the full list of knobs is on this page
and each has a type and a default.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = "ANTUMBRA_CACHE_DIR"


def _str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def cache_dir() -> Path:
    """Where generated artefacts (such as the default tiny model) live; relative to the cwd by default."""
    return Path(_str(CACHE_DIR, ".cache")).expanduser()
