"""Building an engine's parts from a plan: the model in its formats and numerics, sized pools.

Nothing here decides a mode: `plan.resolve_plan` did. These functions carry the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from antumbra.cachestore.pools import KVPools, PoolLayout
from antumbra.cachestore.row_format import RowFormat
from antumbra.cachestore.sizing import hot_buffers_for, virtual_tokens_for_budget
from antumbra.config import EngineConfig, ModelConfig

from .model.fp8_linear import pack_fp8_linears
from .model.kv_rows import index_row_format, kv_row_format
from .model.model import DeepseekV4
from .model.numerics import Numerics
from .model.packed_experts import PackedExperts, pack_experts
from .plan import ExecutionPlan, ExpertFormat, KVStorage, LinearFormat, StepKernels

# Parameters the reference keeps in float32 whatever the model dtype (mixing, sinks, biases, norms).
_FP32_PARAMS = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.weight")


def param_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is held in when the model runs in `dtype`."""
    if not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if any(key in name for key in _FP32_PARAMS) else dtype


@dataclass(frozen=True)
class LoadedModel:
    model: DeepseekV4
    tokenizer: Any | None
    mtp_state_dict: dict[str, torch.Tensor]
    layout: str  # "release" or "hf"


def load_model(path: str | Path, device: str, dtype: torch.dtype, progress: bool | None,
               packed_experts: bool = False) -> LoadedModel:
    """The checkpoint at `path` as a `DeepseekV4` on `device` (dense weights in `dtype`). With
    `packed_experts`, routed experts stored in MXFP4 come as `PackedExperts` read from their codes, never
    dense (`checkpoint_packed`); the rest of the model as without."""
    from .model.checkpoint import load_state_dict
    from .model.checkpoint_files import load_hf_config

    path = Path(path)
    model_config = ModelConfig.from_hf(load_hf_config(path))
    with torch.device("meta"):
        model = DeepseekV4(model_config)
    expected = {name: (tuple(t.shape), param_dtype(name, t, dtype)) for name, t in model.state_dict().items()}
    # Each tensor in its parameter's dtype: those held in float32 (mHC mixing, sinks, biases) keep what
    # the release stores, never rounded through the model dtype on the way.
    loaded = load_state_dict(path, expected, dtype=None, device=device, progress=progress,
                             packed_experts=packed_experts)
    # Own, freshly allocated tensors: not views into the file's buffer, whose 8-byte alignment can
    # send the CPU's matmuls down other (differently rounding) code paths than aligned memory does.
    state = {name: owned_copy(t, device, expected[name][1]) for name, t in loaded.state_dict.items()}
    for prefix, buffers in loaded.packed_experts.items():  # allocated by the loader: owned already
        parent, _, attr = prefix.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, attr, PackedExperts(getattr(holder, attr).limit, buffers))
        state.update({f"{prefix}.{name}": tensor for name, tensor in buffers.items()})
    model.load_state_dict(state, strict=True, assign=True)
    return LoadedModel(model, load_tokenizer(path), loaded.mtp_state_dict, loaded.layout)


def owned_copy(tensor: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`, in memory of its own (never a view of a file's buffer)."""
    moved = tensor.to(device=device, dtype=dtype)
    return moved.clone() if moved.data_ptr() == tensor.data_ptr() else moved.contiguous()


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
    if not (path / "tokenizer.json").exists():
        return None
    from .model.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def prepare_model(model: DeepseekV4, plan: ExecutionPlan) -> DeepseekV4:
    """Put `model` in the plan's numerics, kernels and weight formats (packing is in place)."""
    model.eval()
    # The model runs in this engine's numerics; engines sharing one model share its mode.
    if plan.expert_format is ExpertFormat.MXFP4:
        pack_experts(model)
    if plan.linear_format is LinearFormat.FP8:
        pack_fp8_linears(model)
    # After packing: the packed modules take the numerics mode too (release round trips).
    model.set_numerics(Numerics.of(plan.numerics.value))
    model.set_kernels(plan.step_kernels is StepKernels.TRITON)
    return model


def row_formats(model_config: ModelConfig, plan: ExecutionPlan) -> tuple[RowFormat, RowFormat]:
    """(KV rows, indexer keys) as the pools store them: see `model/kv_rows.py`."""
    numerics = Numerics.of(plan.numerics.value)
    packed = plan.kv_storage is KVStorage.CODES
    mc = model_config
    return (
        kv_row_format(numerics, mc.head_dim, mc.rope_dim, plan.dtype, packed),
        index_row_format(numerics, mc.index_head_dim, plan.dtype, packed),
    )


def build_pools(model_config: ModelConfig, config: EngineConfig, plan: ExecutionPlan) -> KVPools:
    """The KV pools of an engine: SWA pages from the scheduler's limits, virtual capacity from the
    config (or from the device budget when one is given)."""
    sched = config.scheduler
    num_swa_pages = _num_swa_pages(model_config, config)
    cache = config.cache
    formats = row_formats(model_config, plan)
    if cache.device_budget_bytes is not None:
        tokens = virtual_tokens_for_budget(
            model_config, cache, num_swa_pages, sched.max_num_seqs, plan.dtype, formats
        )
        cache = replace(cache, num_virtual_tokens=tokens)
    layout = PoolLayout.build(model_config, cache, num_swa_pages)
    hot = hot_buffers_for(model_config, cache, sched.max_num_seqs, formats[0], plan.device)
    return KVPools(layout, plan.dtype, plan.device, hot, *formats)


def _num_swa_pages(model_config: ModelConfig, config: EngineConfig) -> int:
    """Steady SWA pages for every sequence plus the pages one step's chunks can open (and, when
    speculating, the page a sequence's drafts may reach past its accepted tokens)."""
    if config.cache.num_swa_pages is not None:
        return config.cache.num_swa_pages
    layout = PoolLayout.build(model_config, config.cache, 1)
    chunk_pages = -(-config.scheduler.token_budget // model_config.page_size) + 1
    per_seq = layout.steady_swa_pages_per_seq + config.speculative.draft_pages(model_config.page_size)
    return config.scheduler.max_num_seqs * per_seq + chunk_pages


def max_model_len(model_config: ModelConfig, config: EngineConfig, pools: KVPools) -> int:
    capacity = pools.layout.num_virtual_slots
    wanted = config.scheduler.max_model_len or capacity
    return min(wanted, capacity, model_config.max_position_embeddings)


__all__ = ["LoadedModel", "build_pools", "load_model", "max_model_len", "param_dtype",
           "prepare_model", "row_formats"]
