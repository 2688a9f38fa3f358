"""Names of an MTP block's tensors: in memory (`MTPBlock`), in the release (`mtp.{i}.*`), and the
layer names the loading plan reads them under.

The release names an MTP block's decoder part exactly as a target layer's (`mtp.0.attn.wq_a.weight`
beside `layers.0.attn.wq_a.weight`), so the block's tensors are planned and dequantised as
`layers.{i}.*` by the target's loading code; its own tensors (`e_proj`, `h_proj`, `enorm`, `hnorm`,
`norm`, `hc_head_{fn,base,scale}`) pass through the same plan under `model.layers.{i}.<official>`.
Both the release's `mtp.` and the hybrid layout's `model.mtp.` prefixes are read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from torch import Tensor

from .release_format import mtp_read_back_, mtp_release_tensors

# MTPBlock's own parameters (in-memory name) -> their official names after `mtp.{i}.`.
OWN_NAMES: dict[str, str] = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
LAYER_PREFIX = "layer."
_STORED_RE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
# Stored MTP names that differ from the layer names they load as: released MTP shards have been seen
# naming the attention's KV norm as the module does (`kv_norm`), where target layers store `attn.norm`.
STORED_ALIASES = {"attn.kv_norm.weight": "attn.norm.weight"}


def plan_name(module_name: str, index: int) -> str:
    """An `MTPBlock` state-dict name -> the name the loading plan gives its stored tensor."""
    if module_name.startswith(LAYER_PREFIX):
        return f"model.layers.{index}.{module_name.removeprefix(LAYER_PREFIX)}"
    if module_name not in OWN_NAMES:
        raise KeyError(f"not an MTP block tensor: {module_name}")
    return f"model.layers.{index}.{OWN_NAMES[module_name]}"


def stored_selector(index: int) -> Callable[[str], str | None]:
    """Stored name -> the layer name it is planned under (`mtp.{index}.X` -> `layers.{index}.X`), None
    for tensors of anything else."""

    def select(name: str) -> str | None:
        m = _STORED_RE.match(name)
        if m is None or int(m.group(1)) != index:
            return None
        rest = m.group(2)
        return f"layers.{index}.{STORED_ALIASES.get(rest, rest)}"

    return select


def release_tensors(index: int, block_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An `MTPBlock` state dict (any float dtype) -> `mtp.{index}.*` stored tensors in the release's
    formats."""
    return mtp_release_tensors(index, *_split(block_state))


def read_back_(block_state: Mapping[str, Tensor]) -> None:
    """An `MTPBlock` state dict (float tensors) replaced in place by the values the block serves with
    once `release_tensors` has stored it and loading has read it back: FP8 and MXFP4 weights quantised
    and dequantised, bfloat16 ones rounded, float32 ones unchanged."""
    mtp_read_back_(*_split(block_state))


def _split(block_state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    layer = {k.removeprefix(LAYER_PREFIX): v for k, v in block_state.items() if k.startswith(LAYER_PREFIX)}
    own = {OWN_NAMES[k]: v for k, v in block_state.items() if not k.startswith(LAYER_PREFIX)}
    return layer, own
