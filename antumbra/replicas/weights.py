"""Replacing a live model's weights in place (RL weight sync), in the formats it runs in.

New weights come under the model's dense in-memory names (what `DeepseekV4.state_dict()` lists
before packing, the names a trainer's copy of the model has). Each lands in the tensor that
holds it today, by `copy_`, so captured CUDA graphs keep reading the same addresses:
* a dense parameter or buffer takes the value cast to its dtype;
* packed routed experts (`PackedExperts`) re-quantise the layer's `gate_up_proj` / `down_proj`
  into their MXFP4 codes and scales (both must come together);
* FP8-block linears (`Fp8Linear`) re-quantise `weight` into their e4m3 codes and scales.
Everything is converted and checked (names, shapes) before the first copy, so a bad update
changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from .model.fp8_linear import Fp8Linear
from .model.moe import Experts
from .model.packed_experts import PackedExperts


class WeightUpdateError(ValueError):
    """An update that does not fit the model (the message names the tensors); nothing was changed."""


def read_checkpoint_weights(
    path: str | Path, model: nn.Module, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A checkpoint directory's tensors under the model's dense names (either layout, on the CPU)."""
    from .build import param_dtype
    from .model.checkpoint import load_state_dict
    from .model.model import DeepseekV4

    with torch.device("meta"):
        dense = DeepseekV4(model.config)  # type: ignore[arg-type]
    expected = {n: (tuple(t.shape), param_dtype(n, t, dtype)) for n, t in dense.state_dict().items()}
    return load_state_dict(path, expected, dtype=None, device="cpu", progress=False).state_dict


Writes = list[tuple[torch.Tensor, torch.Tensor]]  # (the live tensor, its new value), checked


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> int:
    """Copy `state` into `model` (see the module docstring); -> the number of tensors written."""
    return commit_writes(stage_weights(model, state))


def commit_writes(writes: Writes) -> int:
    """Copy each checked value into its live tensor, in place; -> the number of tensors written."""
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    return len(writes)


def stage_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> Writes:
    """`state` converted to the formats of `model` and checked (names, shapes), nothing written yet;
    raises WeightUpdateError naming what does not fit."""
    targets = dict(model.state_dict(keep_vars=True))
    packed = {name: m for name, m in model.named_modules() if isinstance(m, PackedExperts | Fp8Linear)}
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    used: set[str] = set()
    for owner, module in packed.items():
        writes += _packed_writes(owner, module, state, used)
    unknown, wrong = [], []
    for name, value in state.items():
        if name in used:
            continue
        target = targets.get(name)
        if target is None:
            unknown.append(name)
        elif tuple(target.shape) != tuple(value.shape):
            wrong.append(f"{name}: {tuple(value.shape)} for {tuple(target.shape)}")
        else:
            writes.append((target, value))
    wrong += [f"packed {tuple(v.shape)} for {tuple(t.shape)}" for t, v in writes if t.shape != v.shape]
    if unknown or wrong:
        raise WeightUpdateError(
            f"the update does not fit the model: unknown {unknown[:5]}, mis-shaped {wrong[:5]}"
        )
    return writes


def _packed_writes(
    owner: str, module: nn.Module, state: Mapping[str, torch.Tensor], used: set[str]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The packed buffers of `module` (named `owner`) re-quantised from the dense weights in `state`."""
    if isinstance(module, Fp8Linear):
        name = f"{owner}.weight"
        if name not in state:
            return []
        used.add(name)
        fresh = Fp8Linear.from_linear(_linear(state[name].to(module.weight.device)))
        return [(module.weight, fresh.weight), (module.weight_scale, fresh.weight_scale)]
    assert isinstance(module, PackedExperts)
    names = (f"{owner}.gate_up_proj", f"{owner}.down_proj")
    present = [n for n in names if n in state]
    if not present:
        return []
    if len(present) == 1:
        raise WeightUpdateError(f"packed experts {owner} need both {names[0]} and {names[1]}")
    used.update(names)
    dense = Experts.__new__(Experts)
    nn.Module.__init__(dense)
    dense.limit = module.limit
    dense.gate_up_proj = nn.Parameter(
        state[names[0]].to(module.w1.device, torch.float32), requires_grad=False
    )
    dense.down_proj = nn.Parameter(state[names[1]].to(module.w1.device, torch.float32), requires_grad=False)
    repacked = PackedExperts.from_experts(dense)
    buffers = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")
    return [(getattr(module, b), getattr(repacked, b)) for b in buffers]


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear
