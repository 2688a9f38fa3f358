"""The model served when none is given: a tiny random DeepSeek-V4 checkpoint, generated once.

`antumbra serve`, a Serve config without models and `antumbra generate` without `--model` all
use it; it lives in `TINY_MODEL_SUBDIR` under `$ANTUMBRA_CACHE_DIR` (default `./.cache`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from antumbra import env

TINY_MODEL_SUBDIR = "tiny-model"
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _is_complete_checkpoint(path: Path) -> bool:
    return all((path / name).is_file() for name in _CHECKPOINT_FILES)


def default_tiny_model_dir() -> Path:
    """The cached tiny checkpoint, generated on first use."""
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    path = env.cache_dir() / TINY_MODEL_SUBDIR
    if _is_complete_checkpoint(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so an interrupted run never leaves a half checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_SUBDIR}-", dir=path.parent))
    try:
        make_tiny_checkpoint(staging, TinyModelSpec(seed=0))
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return path
