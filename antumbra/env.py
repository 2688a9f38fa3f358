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


REDIS_URL = "ANTUMBRA_REDIS_URL"
ADMIN_KEY = "ANTUMBRA_ADMIN_KEY"
NAMESPACE_SECRET = "ANTUMBRA_NAMESPACE_SECRET"


def _optional(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def redis_url() -> str | None:
    """An external Redis (`redis://host:port/db`); None means the platform starts a local one it owns."""
    return _optional(REDIS_URL)


def admin_key() -> str | None:
    """The bearer token of the `/admin` API; None leaves the admin API closed."""
    return _optional(ADMIN_KEY)


def namespace_secret() -> bytes | None:
    """The secret that private cache namespaces are derived from.

    None means the tenant store keeps a random one in Redis, which every ingress
    replica sharing that Redis reads, so they all derive the same namespaces.
    """
    value = _optional(NAMESPACE_SECRET)
    return value.encode() if value is not None else None


KERNEL_CACHE_DIR = "ANTUMBRA_KERNEL_CACHE_DIR"
PLUGINS = "ANTUMBRA_PLUGINS"


def kernel_cache_dir() -> Path:
    """Where compiled Triton kernels persist, shared by every replica of a node (one user's home);
    an explicit `TRITON_CACHE_DIR` wins, since Triton itself reads that."""
    explicit = _optional("TRITON_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return Path(_str(KERNEL_CACHE_DIR, "~/.cache/antumbra/kernels")).expanduser()


def plugins() -> tuple[str, ...]:
    """Plugins every engine of the process loads (`replicas/plugins.py`): `module` or
    `module:argument` entries, comma-separated; none by default."""
    return tuple(entry.strip() for entry in _str(PLUGINS, "").split(",") if entry.strip())
