"""An MTP draft block from a checkpoint directory, and the block written back into one.

Loading reads the `mtp.{i}.*` tensors through the target's loading plan and dequantisation (FP8
linears, MXFP4 experts: `model.checkpoint.load_selected`), in the dtypes the target's parameters of the
same kind take (`build.param_dtype`). Writing stores a block in the release's names and formats in
`mtp.safetensors` beside the target's shards, and drops the tensors it replaces from wherever they
were (the shard index is pointed at the new file; an unindexed file holding them is rewritten without).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from antumbra.config import ModelConfig

from ..build import owned_copy, param_dtype
from ..model.checkpoint import load_selected
from ..model.checkpoint_files import INDEX_FILE, CheckpointError, load_hf_config, weight_files
from ..model.checkpoint_names import is_mtp_name
from ..model.mtp import MTPBlock
from ..model.mtp_names import plan_name, release_tensors, stored_selector
from ..model.tiny import MTP_FILE


def load_mtp(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
             index: int = 0) -> MTPBlock:
    """MTP block `index` of the checkpoint at `path` (`num_nextn_predict_layers` must exceed it), dense
    weights in `dtype` on `device`, in eval mode. Raises CheckpointError naming every missing or
    misshapen tensor."""
    path = Path(path)
    cfg = ModelConfig.from_hf(load_hf_config(path))
    if index >= cfg.num_mtp_layers:
        raise CheckpointError(path, [f"MTP block {index} requested, the config has num_nextn_predict_layers="
                                     f"{cfg.num_mtp_layers}"])
    with torch.device("meta"):
        block = MTPBlock(cfg)
    dtypes = {name: param_dtype(name, t, dtype) for name, t in block.state_dict().items()}
    shapes = {name: tuple(t.shape) for name, t in block.state_dict().items()}
    expected = {plan_name(name, index): (shape, dtypes[name]) for name, shape in shapes.items()}
    loaded = load_selected(path, expected, stored_selector(index), dtype=None, device=device)
    state = {name: owned_copy(loaded[plan_name(name, index)], device, dtypes[name]) for name in dtypes}
    block.load_state_dict(state, strict=True, assign=True)
    return block.eval()


def write_mtp(path: str | Path, blocks: list[MTPBlock]) -> Path:
    """Store `blocks` (block i as `mtp.{i}.*`) in the checkpoint at `path`, replacing its MTP tensors.
    -> the file written."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for i, block in enumerate(blocks):
        # Quantised where the block lives (a GPU rounds a large block's experts and linears far faster
        # than the host), stored from the host.
        state = {k: v.detach().float() for k, v in block.state_dict().items()}
        tensors.update({name: t.cpu() for name, t in release_tensors(i, state).items()})
    stored = weight_files(path)
    holders = sorted({f for name, f in stored.items() if is_mtp_name(name) and f.name != MTP_FILE})
    target = path / MTP_FILE
    save_file(tensors, str(target), metadata={"format": "pt"})
    index_file = path / INDEX_FILE
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        weights = {k: v for k, v in index["weight_map"].items() if not is_mtp_name(k)}
        weights.update(dict.fromkeys(tensors, MTP_FILE))
        index["weight_map"] = dict(sorted(weights.items()))
        index_file.write_text(json.dumps(index, indent=2) + "\n")
        return target
    for file in holders:  # no index: every file is read, so the old copies must go
        with safe_open(file, framework="pt") as fh:
            metadata = fh.metadata()
        kept = {k: v for k, v in load_file(file).items() if not is_mtp_name(k)}
        save_file(kept, str(file), metadata=metadata)
    return target
