"""Routed experts read straight into the packed MXFP4 buffers `PackedExperts` serves from.

A release checkpoint stores each routed expert's w1 / w3 / w2 as e2m1 codes (int8, two a byte) with a
UE8M0 scale per 32 inputs: the format the MoE kernels read. When the engine keeps its experts packed,
an experts module whose every piece is stored so is copied piece by piece into `[E, rows, in/2]` codes
and `[E, rows, in/32]` scales, never dequantised. Loading then needs the packed bytes (about a quarter
of bf16's), not a layer in the model dtype beside them. A module with any piece stored otherwise (an
unquantised or float-scaled expert) loads dense and is packed after loading, as before.

The buffers hold the stored codes and scales. They decode to exactly the weights the dense load gives;
their bytes may differ from what packing those weights gives, where the checkpoint's writer chose a
larger scale for a group than the smallest that covers it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from antumbra.replicas.model.checkpoint_plan import Expected, LoadItem, in_file_order

PackedLayers = dict[str, dict[str, Tensor]]  # experts module prefix → w1, w1_scale, w3, ..., w2_scale

_CODE_DTYPES = ("I8", "U8")
_EXPONENT_DTYPES = ("F8_E8M0", "U8")  # UE8M0 scales as stored: exponent bytes


def experts_prefix(target: str) -> str:
    """`model.layers.3.mlp.experts.gate_up_proj` → `model.layers.3.mlp.experts`."""
    return target.rsplit(".", 1)[0]


def _stored_packed(item: LoadItem) -> bool:
    return (item.weight.dtype in _CODE_DTYPES and item.scale is not None
            and item.scale.dtype in _EXPONENT_DTYPES)


def split_packed(items: list[LoadItem]) -> tuple[list[LoadItem], list[LoadItem]]:
    """-> (items to load dense, expert pieces to read packed): the second holds every piece of each
    experts module whose pieces are all MXFP4 codes with exponent-byte scales."""
    packable: dict[str, bool] = {}
    for item in items:
        if item.slot is not None:
            prefix = experts_prefix(item.target)
            packable[prefix] = packable.get(prefix, True) and _stored_packed(item)
    chosen = {prefix for prefix, ok in packable.items() if ok}
    is_packed = [it.slot is not None and experts_prefix(it.target) in chosen for it in items]
    return ([it for it, p in zip(items, is_packed, strict=True) if not p],
            [it for it, p in zip(items, is_packed, strict=True) if p])


def load_packed(
    items: list[LoadItem],
    handles: Mapping[Any, Any],
    expected: Expected,
    device: torch.device,
    progress: Callable[[int], Any],
) -> PackedLayers:
    """Read `split_packed`'s pieces into each module's buffers on `device` (codes int8, scales
    float8_e8m0fnu, as `PackedExperts.from_experts` makes them); `progress(nbytes)` after each piece.
    `plan_load` has checked that every expert's pieces exist with consistent shapes."""
    out: PackedLayers = {}
    for item in in_file_order(items):
        assert item.slot is not None and item.scale is not None
        codes = handles[item.weight.file].get_tensor(item.weight.name).to(device).view(torch.int8)
        scale = handles[item.scale.file].get_tensor(item.scale.name).to(device).view(torch.float8_e8m0fnu)
        buffers = out.setdefault(experts_prefix(item.target), {})
        name = item.slot.proj
        if name not in buffers:
            num_experts = expected[item.target][0][0]
            for key, piece in ((name, codes), (f"{name}_scale", scale)):
                buffers[key] = torch.empty((num_experts, *piece.shape), dtype=piece.dtype, device=device)
        buffers[name][item.slot.expert].copy_(codes)
        buffers[f"{name}_scale"][item.slot.expert].copy_(scale)
        progress(item.nbytes)
    return out
