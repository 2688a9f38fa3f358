"""Where compiled kernels persist between processes.

Triton keeps each compiled variant on disk under its cache directory; pointing every replica of
a node at one directory means only the first replica ever compiles a variant, and the others
(and every restart) load it in milliseconds during their warm-up.
"""

from __future__ import annotations

from pathlib import Path


def use_kernel_cache(path: Path) -> Path:
    """Make Triton read and write compiled kernels under `path` (created if missing) in this
    process and the processes it starts; -> the directory."""
    from triton import knobs

    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(path)
    return path
