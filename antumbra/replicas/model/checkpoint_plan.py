"""The loading plan: every stored tensor matched to its target from header metadata only, before any
tensor data is read, so a checkpoint that does not fit the model fails with every problem listed."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from antumbra.replicas.model.checkpoint_names import ExpertSlot, classify, is_mtp_name
from antumbra.replicas.model.quant import MXFP4_BLOCK, fp8_scale_shape

Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 1)


@dataclass(frozen=True)
class LoadItem:
    """One stored weight (plus its scale) and where its dequantised value goes."""

    weight: StoredTensor
    scale: StoredTensor | None
    target: str
    slot: ExpertSlot | None = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)


def in_file_order(items: list[LoadItem]) -> Iterator[LoadItem]:
    # Reading shard by shard keeps the page cache and disk access sequential.
    yield from sorted(items, key=lambda it: (str(it.weight.file), it.weight.name))


@dataclass
class LoadPlan:
    items: list[LoadItem] = field(default_factory=list)
    mtp: list[StoredTensor] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _scale_owner(name: str, names: Mapping[str, Any]) -> str | None:
    """Weight name a quantisation scale belongs to, or None if `name` is not a scale."""
    for suffix in (".scale", ".weight_scale_inv"):
        if name.endswith(suffix):
            owner = name[: -len(suffix)] + ".weight"
            if owner in names:
                return owner
    return None


def _dequantised_shape(
    weight: StoredTensor, scale: StoredTensor | None, block: int
) -> tuple[tuple[int, ...], str | None]:
    """Shape after dequantisation and a problem description (None when the pair is consistent)."""
    if scale is None:
        if weight.dtype.startswith("F8_") or weight.dtype in ("I8", "U8"):
            # Casting quantised codes without their scale would load silently wrong values.
            return weight.shape, f"{weight.name} is stored as {weight.dtype} without a scale"
        return weight.shape, None
    if weight.dtype in ("I8", "U8"):
        *lead, out, half = weight.shape
        shape = (*lead, out, 2 * half)
        want = (*lead, out, 2 * half // MXFP4_BLOCK)
        if (2 * half) % MXFP4_BLOCK == 0 and scale.shape == want:
            return shape, None
        return shape, f"MXFP4 scale {scale.name} has shape {scale.shape}, expected {want}"
    if weight.dtype.startswith("F8_"):
        want = fp8_scale_shape(weight.shape, block)
        if scale.shape == want:
            return weight.shape, None
        return weight.shape, f"FP8 scale {scale.name} has shape {scale.shape}, expected {want}"
    return weight.shape, f"{weight.name} has a scale but dtype {weight.dtype} is not FP8 or packed FP4"


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint weight lands: `key` names the tensor (or expert piece) in messages."""

    name: str
    key: str
    shape: tuple[int, ...]  # expected shape of this source after dequantisation
    slot: ExpertSlot | None


def _target_of(name: str, shape: tuple[int, ...], expected: Expected) -> _Target | str:
    """Resolve a checkpoint weight name to its target, or describe why it has none."""
    kind = classify(name)
    target = kind.target if isinstance(kind, ExpertSlot) else kind
    if target not in expected:
        return f"unexpected tensor {name} {shape} (would load as {target})"
    want = tuple(expected[target][0])
    if not isinstance(kind, ExpertSlot):
        return _Target(target, target, want, None)
    if len(want) != 3 or kind.expert >= want[0]:
        return f"unexpected tensor {name}: expert {kind.expert} beyond {target} {want}"
    return _Target(target, f"{target}[expert {kind.expert} {kind.proj}]", kind.piece_shape(want), kind)


def plan_load(stored: Mapping[str, StoredTensor], expected: Expected, block: int) -> LoadPlan:
    plan = LoadPlan()
    scales = {owner: stored[name] for name in stored if (owner := _scale_owner(name, stored))}
    sources: dict[str, list[str]] = {}  # target key → checkpoint names, to find duplicates and gaps
    for name, info in stored.items():
        if is_mtp_name(name):
            plan.mtp.append(info)
            continue
        if _scale_owner(name, stored):
            continue
        target = _target_of(name, info.shape, expected)
        if isinstance(target, str):
            plan.problems.append(target)
            continue
        sources.setdefault(target.key, []).append(name)
        scale = scales.get(name)
        shape, problem = _dequantised_shape(info, scale, block)
        # A broken weight/scale pair is reported alone: its dequantised shape means nothing.
        if problem is None and shape != target.shape:
            problem = f"shape mismatch {name} -> {target.key}: expected {target.shape}, found {shape}"
        if problem:
            plan.problems.append(problem)
            continue
        plan.items.append(LoadItem(info, scale, target.name, target.slot))
    plan.problems += [f"duplicate sources for {k}: {', '.join(v)}" for k, v in sources.items() if len(v) > 1]
    plan.problems += _missing(expected, sources)
    return plan


def _missing(expected: Expected, sources: Mapping[str, list[str]]) -> list[str]:
    out = []
    for target, (shape, _) in expected.items():
        if target in sources:
            continue
        if target.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and len(shape) == 3:
            projs = ("w2",) if target.endswith("down_proj") else ("w1", "w3")
            gaps = [f"{target}[expert {e} {p}]" for e in range(shape[0]) for p in projs
                    if f"{target}[expert {e} {p}]" not in sources]
            if len(gaps) < shape[0] * len(projs):  # stored per expert, some pieces absent
                out += [f"missing tensor {g}" for g in gaps]
                continue
        out.append(f"missing tensor {target} {tuple(shape)}")
    return out
