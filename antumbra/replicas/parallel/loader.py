"""Sharded streaming loading: each rank reads only its part of each tensor from the safetensors files.

The checkpoint is first planned against the *full* model from header metadata alone
(`checkpoint_plan.plan_load`: every missing, unexpected, duplicated or mis-shaped tensor is named, with
the rank that found it), then each rank walks the tensors in file order and reads, per tensor:
* nothing, for routed experts outside its expert range;
* the slice it holds (`spec.py`), through `safe_open(...).get_slice`: for an FP8 block-quantised
  weight the block-aligned rows / columns covering the slice and their scales, for an MXFP4
  expert the rows, or the 32-aligned columns, and their scales; the slice is dequantised on the
  rank's device and narrowed to the exact shard;
* the whole tensor, for replicated ones.
So a rank's host memory holds at most one tensor's slice at a time (plus the merged expert
tensors it fills on its device), never the checkpoint. Dense tensors land in their parameter's dtype
(the model dtype, or float32 for those held in float32);
with the plan's packed formats (MXFP4 experts, FP8 linears) the rank's model is packed before
loading and those tensors land as stored, codes and scales (`packed_load.py`).

Invariant (tested): the bytes a rank holds are exactly `ShardSpec.local_shape` of every tensor.
"""

from __future__ import annotations

import resource
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from antumbra.config import ModelConfig

from ..build import owned_copy, param_dtype
from ..model.checkpoint import CheckpointError, read_metadata
from ..model.checkpoint_files import fp8_block_size, weight_files
from ..model.checkpoint_plan import LoadItem, plan_load
from ..model.model import DeepseekV4
from ..model.quant import MXFP4_BLOCK, dequant_fp8_block, unpack_mxfp4
from .packed_load import PACKED_DTYPES, load_packed
from .spec import ExpertShard, Shard, ShardSpec


@dataclass(frozen=True)
class ShardLoad:
    state_dict: dict[str, torch.Tensor]  # the rank's model parameters and buffers, on its device
    mtp_state_dict: dict[str, torch.Tensor]  # rank 0 only (MTP weights are not sharded)
    bytes_read: int  # bytes of stored tensor data this rank read (aligned slices included)
    bytes_held: int  # bytes of `state_dict`
    peak_rss_bytes: int  # this process's peak resident memory when the load ended


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _narrow_read(fh: Any, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    sl = fh.get_slice(name)
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def _read(
    handles: dict, item: LoadItem, dim: int | None, start: int, stop: int, block: int
) -> tuple[torch.Tensor, int]:
    """Rows (`dim` 0) or columns (`dim` 1) [start, stop) of the item's dequantised weight (all of
    it when `dim` is None), as float32 for quantised pairs; -> (tensor, bytes read)."""
    w, s = item.weight, item.scale
    wf = handles[w.file]
    if dim is None:
        weight = wf.get_tensor(w.name)
        scale = handles[s.file].get_tensor(s.name) if s else None
        read = weight.numel() * weight.element_size()
        read += scale.numel() * scale.element_size() if scale is not None else 0
        if scale is None:
            return weight, read
        if weight.dtype in (torch.int8, torch.uint8):
            return unpack_mxfp4(weight, scale), read
        return dequant_fp8_block(weight, scale, block), read
    if s is None:
        weight = _narrow_read(wf, w.name, dim, start, stop)
        return weight, weight.numel() * weight.element_size()
    sf = handles[s.file]
    if w.dtype in ("I8", "U8"):  # MXFP4: [out, in/2] codes, [out, in/32] scales
        if dim == 1 and (start % MXFP4_BLOCK or stop % MXFP4_BLOCK):
            problem = f"{w.name}: columns {start}:{stop} are not aligned to MXFP4 blocks"
            raise CheckpointError(w.file, [problem])
        cut = (start, stop) if dim == 0 else (start // 2, stop // 2)
        scut = (start, stop) if dim == 0 else (start // MXFP4_BLOCK, stop // MXFP4_BLOCK)
        weight = _narrow_read(wf, w.name, dim, *cut)
        scale = _narrow_read(sf, s.name, dim, *scut)
        return unpack_mxfp4(weight, scale), weight.numel() + scale.numel() * scale.element_size()
    full = w.shape[dim]
    a, b = start // block * block, min(-(-stop // block) * block, full)
    weight = _narrow_read(wf, w.name, dim, a, b)
    scale = _narrow_read(sf, s.name, dim, a // block, -(-b // block))
    value = dequant_fp8_block(weight, scale, block).narrow(dim, start - a, stop - start)
    return value, weight.numel() + scale.numel() * scale.element_size()


def load_shard(
    path: str | Path, cfg: ModelConfig, spec: ShardSpec, model: DeepseekV4, device: torch.device,
    dtype: torch.dtype, progress: bool = False,
) -> ShardLoad:
    """Read this rank's shard of the checkpoint at `path` for `model` (the rank's meta model)."""
    path = Path(path)
    with torch.device("meta"):
        full = DeepseekV4(cfg)
    expected = {n: (tuple(t.shape), param_dtype(n, t, dtype)) for n, t in full.state_dict().items()}
    local = {n: (tuple(t.shape), t.dtype if t.dtype in PACKED_DTYPES else param_dtype(n, t, dtype))
             for n, t in model.state_dict().items()}
    files = weight_files(path)
    block = fp8_block_size(path)
    state: dict[str, torch.Tensor] = {}
    mtp: dict[str, torch.Tensor] = {}
    bytes_read = 0
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(files.values()))}
        plan = plan_load(read_metadata(handles, files), expected, block)
        if plan.problems:
            raise CheckpointError(path, [f"rank {spec.rank}: {p}" for p in plan.problems])
        items = sorted(plan.items, key=lambda it: (str(it.weight.file), it.weight.name))
        bar = tqdm(total=sum(it.nbytes for it in items), unit="B", unit_scale=True,
                   desc=f"rank {spec.rank} loading {path.name}", disable=not progress)
        with bar:
            for item in items:
                bytes_read += _load_item(item, handles, cfg, spec, expected, local, state, device, block)
                bar.update(item.nbytes)
            if spec.rank == 0:
                for info in plan.mtp:
                    mtp[info.name] = handles[info.file].get_tensor(info.name).to(device)
    problems = [f"rank {spec.rank}: {n} holds {tuple(state[n].shape)}, the rank's model wants {shape}"
                for n, (shape, _) in local.items() if n in state and tuple(state[n].shape) != shape]
    problems += [f"rank {spec.rank}: nothing loaded into {n}" for n in local if n not in state]
    if problems:
        raise CheckpointError(path, problems)
    held = sum(t.numel() * t.element_size() for t in state.values())
    return ShardLoad({n: state[n] for n in local}, mtp, bytes_read, held, peak_rss_bytes())


def _load_item(item, handles, cfg, spec, expected, local, state, device, block) -> int:
    """Read `item`'s part into `state` (merged experts filled in place); -> bytes read."""
    def read_dense(it: LoadItem, dim: int | None, start: int, stop: int) -> tuple[torch.Tensor, int]:
        return _read(handles, it, dim, start, stop, block)

    packed = load_packed(item, handles, cfg, spec, expected, local, state, device, read_dense)
    if packed is not None:
        return packed
    full_shape, want = expected[item.target]
    out_dtype = want  # the parameter's own dtype: those held in float32 keep what the release stores
    shard = spec.shard_of(item.target, full_shape, cfg)
    if item.slot is None:
        if isinstance(shard, Shard):
            value, read = _read(handles, item, shard.dim, shard.start, shard.stop, block)
        else:  # replicated, or merged experts stored whole (in-memory names): cut after reading
            value, read = _read(handles, item, None, 0, 0, block)
            if isinstance(shard, ExpertShard):
                from .layers import shard_tensor

                value = shard_tensor(value, item.target, spec, cfg)
        state[item.target] = owned_copy(value, str(device), out_dtype)
        return read
    slot = item.slot
    if shard is None:
        first, count, inner = 0, full_shape[0], None
    else:
        first, count, inner = shard.first, shard.count, shard.inner
    assert not isinstance(inner, ExpertShard)
    if not first <= slot.expert < first + count:
        return 0  # another rank's expert
    if item.target not in state:
        state[item.target] = torch.zeros(local[item.target][0], dtype=out_dtype, device=device)
    merged = state[item.target]
    if inner is None:
        value, read = _read(handles, item, None, 0, 0, block)
        rows = slot.rows(full_shape)
    else:
        # w1 / w3 pieces [I, D] split by rows; w2 pieces [D, I] split by columns.
        dim = 1 if slot.proj == "w2" else 0
        value, read = _read(handles, item, dim, inner.start, inner.stop, block)
        width = inner.stop - inner.start
        rows = slice(0, merged.shape[1]) if slot.proj == "w2" else (
            slice(0, width) if slot.proj == "w1" else slice(width, 2 * width))
    merged[slot.expert - first, rows].copy_(value.to(out_dtype))
    return read


__all__ = ["ShardLoad", "load_shard", "peak_rss_bytes"]
