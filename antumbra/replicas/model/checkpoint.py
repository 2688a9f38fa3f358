"""Read DeepSeek-V4 checkpoints into the transformers in-memory naming.

Two on-disk layouts are accepted, single-file or sharded (`model.safetensors.index.json`):

* ``"hf"``: what `DeepseekV4ForCausalLM.save_pretrained` writes. It is a hybrid: official module names
  under a `model.` prefix (`model.layers.0.attn.wq_a.weight`, per-expert
  `model.layers.0.ffn.experts.3.w1.weight`), except `model.embed_tokens.weight`, `model.norm.weight`,
  `model.hc_head.hc_fn` and `head.weight`; tensors unquantised, `tid2eid` int64. Plain in-memory
  names (`model.layers.0.self_attn.q_a_proj.weight`, merged `mlp.experts.gate_up_proj`) are also
  accepted.
* ``"release"``: the official layout, without prefix (`embed.weight`, `layers.0.attn.wq_a.weight`),
  with FP8 block-quantised linears (`.weight` e4m3 + `.scale` UE8M0), MXFP4 routed experts
  (`.weight` int8 `[out, in/2]` + `.scale` `[out, in/32]`), int32 `tid2eid`, and `mtp.*` tensors.

The result is keyed exactly like `transformers.DeepseekV4ForCausalLM(config).state_dict()`: routed
experts merged into `mlp.experts.gate_up_proj [E, 2I, D]` (w1 rows, then w3 rows) and
`mlp.experts.down_proj [E, D, I]`, all quantised tensors dequantised. `mtp.*` tensors are returned
separately, as stored.

Names are mapped in `checkpoint_names`, files and layout found in `checkpoint_files`, every
tensor matched to its target before reading in `checkpoint_plan`; this module reads the data.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

from antumbra.replicas.model.checkpoint_files import (
    CheckpointError,
    Layout,
    fp8_block_size,
    layout_of,
    weight_files,
)
from antumbra.replicas.model.checkpoint_packed import PackedLayers, load_packed, split_packed
from antumbra.replicas.model.checkpoint_plan import Expected, LoadItem, StoredTensor, in_file_order, plan_load
from antumbra.replicas.model.quant import dequant_fp8_block, unpack_mxfp4

_PROGRESS_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class LoadedCheckpoint:
    """state_dict: in-memory names → tensors (floating ones in the requested dtype, integer ones in the
    expected dtype). mtp_state_dict: the `mtp.*` tensors under their stored names and dtypes.
    layout: `"hf"` or `"release"`."""

    state_dict: dict[str, Tensor]
    mtp_state_dict: dict[str, Tensor]
    layout: Layout
    # `packed_experts`: each experts module's prefix → its `PackedExperts` buffers, read as stored;
    # those modules' merged tensors are not in `state_dict`.
    packed_experts: PackedLayers = field(default_factory=dict)


def expected_from_module(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`module.state_dict()` → `{name: (shape, dtype)}` (works on meta-device modules)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def hf_expected(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected names, shapes and dtypes of `DeepseekV4ForCausalLM(config)`, built on the meta device."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        return expected_from_module(DeepseekV4ForCausalLM(config))


def read_metadata(handles: Mapping[Path, Any], files: Mapping[str, Path]) -> dict[str, StoredTensor]:
    out = {}
    for name, file in files.items():
        sl = handles[file].get_slice(name)
        out[name] = StoredTensor(name, file, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _dequantise(weight: Tensor, scale: Tensor | None, block: int) -> Tensor:
    """Stored weight (+ scale) → float32 for quantised pairs, else the tensor unchanged."""
    if scale is None:
        return weight
    if weight.dtype in (torch.int8, torch.uint8):
        return unpack_mxfp4(weight, scale)
    return dequant_fp8_block(weight, scale, block)


def loaded_dtype(expected_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor loads in: `dtype` for floating-point tensors when given, else as expected."""
    if not expected_dtype.is_floating_point or dtype is None:
        return expected_dtype
    return dtype


def _show_progress(progress: bool | None, total_bytes: int) -> bool:
    if progress is not None:
        return progress
    return total_bytes > _PROGRESS_MIN_BYTES or sys.stderr.isatty()


def load_state_dict(
    path: str | Path,
    expected: Expected,
    *,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    packed_experts: bool = False,
) -> LoadedCheckpoint:
    """Load a checkpoint directory (or one `.safetensors` file) in either layout.

    expected: in-memory name → (shape, dtype) of every tensor the model needs, e.g.
        `expected_from_module(model)` or `hf_expected(config)`.
    dtype: dtype of every floating tensor in the result (None: each tensor's expected dtype). Integer
        tensors (`tid2eid`) take their expected dtype.
    Raises CheckpointError naming every missing, unexpected, duplicated or misshapen tensor before any
    tensor data is read. Tensors are read lazily one at a time; merged expert tensors are allocated
    once and filled piece by piece.
    packed_experts: experts modules whose every piece is stored in MXFP4 are read into packed buffers
        instead (`checkpoint_packed`), never dequantised.
    """
    path = Path(path)
    files = weight_files(path)
    block = fp8_block_size(path)
    with ExitStack() as stack:
        handles, stored = _open_all(stack, files)
        plan = plan_load(stored, expected, block)
        if plan.problems:
            raise CheckpointError(path, plan.problems)
        total = sum(it.nbytes for it in plan.items) + sum(s.nbytes for s in plan.mtp)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
                   disable=not _show_progress(progress, total))
        dense_items, packed_items = split_packed(plan.items) if packed_experts else (plan.items, [])
        packed_targets = {it.target for it in packed_items}
        dense_expected = {k: v for k, v in expected.items() if k not in packed_targets}
        with bar:
            state = _load_items(dense_items, handles, dense_expected, dtype, torch.device(device), block, bar)
            packed = load_packed(packed_items, handles, expected, torch.device(device), bar.update)
            mtp = {}
            for info in plan.mtp:
                mtp[info.name] = handles[info.file].get_tensor(info.name).to(device)
                bar.update(info.nbytes)
    return LoadedCheckpoint(state_dict=state, mtp_state_dict=mtp, layout=layout_of(files),
                            packed_experts=packed)


def load_selected(
    path: str | Path,
    expected: Expected,
    select: Callable[[str], str | None],
    *,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """The stored tensors `select` maps to a name (others are skipped), loaded as `load_state_dict`
    loads the target's: `select(stored name)` is the name they are planned under (an official or
    hybrid release name, e.g. an MTP block's tensors under a layer's names), the result is keyed by
    `expected`'s names, dequantised from FP8 / MXFP4 by the same code. Raises CheckpointError naming
    every problem before any tensor data is read."""
    path = Path(path)
    files = weight_files(path)
    block = fp8_block_size(path)
    with ExitStack() as stack:
        handles, stored = _open_all(stack, files)
        chosen = {new: info for name, info in stored.items() if (new := select(name)) is not None}
        plan = plan_load(chosen, expected, block)
        if plan.problems:
            raise CheckpointError(path, plan.problems)
        bar = tqdm(total=sum(it.nbytes for it in plan.items), disable=True)
        return _load_items(plan.items, handles, expected, dtype, torch.device(device), block, bar)


def _load_items(
    items: list[LoadItem],
    handles: Mapping[Path, Any],
    expected: Expected,
    dtype: torch.dtype | None,
    device: torch.device,
    block: int,
    bar: tqdm,
) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for item in in_file_order(items):
        fh = handles[item.weight.file]
        weight = fh.get_tensor(item.weight.name).to(device)
        scale = handles[item.scale.file].get_tensor(item.scale.name).to(device) if item.scale else None
        shape, want_dtype = expected[item.target]
        value = _dequantise(weight, scale, block).to(loaded_dtype(want_dtype, dtype))
        if item.slot is None:
            state[item.target] = value
        else:
            if item.target not in state:
                state[item.target] = torch.empty(shape, dtype=value.dtype, device=device)
            state[item.target][item.slot.expert, item.slot.rows(shape)].copy_(value)
        bar.update(item.nbytes)
    # Preserve the model's key order so `state_dict` iterates like `module.state_dict()`.
    return {k: state[k] for k in expected}


def _open_all(stack: ExitStack, files: dict[str, Any]) -> tuple[dict[Any, Any], Any]:
    """Every weight file opened lazily (closed with `stack`), and the stored tensors' metadata."""
    handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(files.values()))}
    return handles, read_metadata(handles, files)
