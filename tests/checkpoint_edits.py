"""Checkpoints made from another for a test: the same model with some weights changed."""

from __future__ import annotations

import shutil
from pathlib import Path


def checkpoint_with_new_head(source: Path, out: Path) -> Path:
    """A copy of the checkpoint at `source` whose lm_head is perturbed (its greedy text changes)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    head = "head.weight"  # the lm_head, under the name save_pretrained writes
    weights[head] = weights[head] + torch.randn(weights[head].shape, generator=g)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
