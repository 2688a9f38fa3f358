"""Loading a rank's shard straight into the packed formats: MXFP4 experts and FP8-block linears.

When the plan keeps routed experts in MXFP4 (`PackedExperts`) and the release's linears in FP8
(`Fp8Linear`), the rank's meta model is packed before loading, and the tensors that land in
packed buffers are copied as the checkpoint stores them, never expanded to the model dtype:
* an MXFP4 expert piece: its rows (w1 / w3, a TP slice of the intermediate) or its columns (w2,
  32-aligned) of the e2m1 codes and their UE8M0 scales, into the rank's stacked buffers;
* an FP8 weight: the codes and scales of its rows / columns when the slice starts on a block
  boundary or lies inside one block (each local block then has one original scale); any other
  slice (or a dense checkpoint) is read dense and quantised, the one-rank packing's arithmetic.
So a V4-Flash rank never holds its experts in bf16 (a quarter of the 284B parameters would be
~140 GB a rank), only in the ~4.25 bits a weight the kernels read.
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.checkpoint_plan import LoadItem
from ..model.quant import FP8_BLOCK, MXFP4_BLOCK, quant_fp8_block, quant_mxfp4
from .spec import ExpertShard, Shard, ShardSpec

PACKED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


def _raw(fh: Any, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
    if dim is None:
        return fh.get_tensor(name)
    sl = fh.get_slice(name)
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _buffer(state: dict, local: dict, name: str, device: torch.device) -> torch.Tensor:
    if name not in state:
        shape, dtype = local[name]
        state[name] = torch.zeros(shape, dtype=dtype, device=device)
    return state[name]


def load_packed(item: LoadItem, handles: dict, cfg: Any, spec: ShardSpec, expected: dict, local: dict,
                state: dict, device: torch.device, read_dense: Any) -> int | None:
    """Load `item` into packed buffers if its target is packed on this rank; -> bytes read, or
    None when the target is dense (the caller loads it). `read_dense(item, dim, start, stop)` reads
    a dequantised slice (the fallback for slices the stored blocks do not cover one to one)."""
    full_shape = expected[item.target][0]
    shard = spec.shard_of(item.target, full_shape, cfg)
    if item.slot is not None:
        owner = item.target.rsplit(".", 1)[0]  # "...mlp.experts"
        if f"{owner}.w1" not in local:
            return None
        if isinstance(shard, ExpertShard):
            first, count, inner = shard.first, shard.count, shard.inner
        else:
            first, count, inner = 0, full_shape[0], None
        if not first <= item.slot.expert < first + count:
            return 0
        e = item.slot.expert - first
        return _expert_piece(item, handles, owner, e, inner, local, state, device, read_dense)
    scale_name = item.target.removesuffix(".weight") + ".weight_scale"
    if scale_name not in local or local[item.target][1] != torch.float8_e4m3fn:
        return None
    assert not isinstance(shard, ExpertShard)
    return _fp8_weight(item, handles, scale_name, shard, local, state, device, read_dense)


def _expert_piece(item, handles, owner, e, inner: Shard | None, local, state, device, read_dense) -> int:
    proj = item.slot.proj
    w, s = item.weight, item.scale
    dim = None if inner is None else (1 if proj == "w2" else 0)
    start, stop = (0, 0) if inner is None else (inner.start, inner.stop)
    if s is not None and w.dtype in ("I8", "U8"):
        if dim == 1 and (start % MXFP4_BLOCK or stop % MXFP4_BLOCK):
            raise ValueError(f"{w.name}: columns {start}:{stop} of a TP shard are not whole MXFP4 blocks")
        cut = (start, stop) if dim != 1 else (start // 2, stop // 2)
        scut = (start, stop) if dim != 1 else (start // MXFP4_BLOCK, stop // MXFP4_BLOCK)
        codes = _raw(handles[w.file], w.name, dim, *cut)
        scale = _raw(handles[s.file], s.name, dim, *scut)
        read = _nbytes(codes, scale)
    else:
        value, read = read_dense(item, dim, start, stop)
        codes, scale = quant_mxfp4(value.float())
    _buffer(state, local, f"{owner}.{proj}", device)[e].copy_(codes.view(torch.int8))
    scale_name = f"{owner}.{proj}_scale"
    _buffer(state, local, scale_name, device)[e].copy_(scale.view(local[scale_name][1]))
    return read


def _fp8_weight(item, handles, scale_name, shard: Shard | None, local, state, device, read_dense) -> int:
    w, s = item.weight, item.scale
    dim = None if shard is None else shard.dim
    start, stop = (0, 0) if shard is None else (shard.start, shard.stop)
    one_to_one = shard is None or start % FP8_BLOCK == 0 or start // FP8_BLOCK == (stop - 1) // FP8_BLOCK
    if s is not None and w.dtype == "F8_E4M3" and one_to_one:
        codes = _raw(handles[w.file], w.name, dim, start, stop)
        b0 = start // FP8_BLOCK
        b1 = b0 + 1 if dim is not None and b0 == (stop - 1) // FP8_BLOCK else -(-stop // FP8_BLOCK)
        scale = _raw(handles[s.file], s.name, dim, b0, b1)
        read = _nbytes(codes, scale)
    else:
        value, read = read_dense(item, dim, start, stop)
        codes, scale = quant_fp8_block(value.float())
    state[item.target] = codes.to(device).contiguous()
    state[scale_name] = scale.to(device=device).view(local[scale_name][1]).contiguous()
    return read


__all__ = ["PACKED_DTYPES", "load_packed"]
