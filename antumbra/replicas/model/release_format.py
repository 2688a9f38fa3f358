"""Write a checkpoint in the official DeepSeek-V4 release layout.

Names are the official unprefixed ones (`embed.weight`, `layers.0.attn.wq_a.weight`, ...), stored as
the release stores them:

* FP8 e4m3 + `.scale` UE8M0 per 128×128 block: attention wq_a, wq_b, wkv, wo_a, wo_b, indexer.wq_b,
  shared_experts w1/w2/w3;
* MXFP4 (int8 `[out, in/2]` + `.scale` UE8M0 `[out, in/32]`): routed experts
  `layers.L.ffn.experts.E.w{1,2,3}.weight`;
* float32: attn_sink, ape, hc_*, gate.bias; int32: tid2eid; bfloat16: everything else.

Used to build release-format fixtures from a transformers-named state dict. Both
`transformers.DeepseekV4ForCausalLM.from_pretrained` and `checkpoint.load_state_dict` read the result.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from antumbra.replicas.model.checkpoint_files import CONFIG_FILE, INDEX_FILE
from antumbra.replicas.model.checkpoint_names import GLOBAL_RENAMES, LAYER_RENAMES, is_mtp_name
from antumbra.replicas.model.quant import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    dequant_fp8_block,
    fp8_scale_shape,
    quant_fp8_block,
    quant_mxfp4,
    unpack_mxfp4,
)

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "activation_scheme": "dynamic",
}
EXPERT_DTYPE = "fp4"

_FP8_LAYER_NAMES = frozenset(
    f"{module}.weight"
    for module in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
                   "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
)
_F32_LAYER_NAMES = frozenset(
    ["attn.attn_sink", "attn.compressor.ape", "attn.indexer.compressor.ape", "ffn.gate.bias"]
    + [f"hc_{b}_{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")]
)
_F32_GLOBAL_NAMES = frozenset({"hc_head_fn", "hc_head_base", "hc_head_scale"})
_I32_LAYER_NAMES = frozenset({"ffn.gate.tid2eid"})

_HF_GLOBAL = {hf: official for official, hf in GLOBAL_RENAMES.items()}
_HF_LAYER = {hf: official for official, hf in LAYER_RENAMES.items()}
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERTS_RE = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class _Unit:
    """One official weight and how to produce it; a weight and its scale always share a shard."""

    name: str
    fmt: str  # "fp8" | "fp4" | "bf16" | "f32" | "i32" | "raw"
    source: Tensor  # unquantised value (a view into the caller's tensor, never a copy)

    @property
    def nbytes(self) -> int:
        n = self.source.numel()
        if self.fmt == "fp8":
            return n + math.prod(fp8_scale_shape(tuple(self.source.shape)))
        if self.fmt == "fp4":
            return n // 2 + n // MXFP4_BLOCK
        return n * {"bf16": 2, "f32": 4, "i32": 4}.get(self.fmt, self.source.element_size())

    def tensors(self) -> dict[str, Tensor]:
        """Official name → stored tensor(s): the weight, plus `.scale` for quantised formats."""
        w = self.source
        if self.fmt == "raw":
            return {self.name: w.contiguous()}
        if self.fmt in ("fp8", "fp4"):
            q, s = quant_fp8_block(w) if self.fmt == "fp8" else quant_mxfp4(w)
            return {self.name: q, self.name.removesuffix(".weight") + ".scale": s}
        dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32}[self.fmt]
        return {self.name: w.to(dtype).contiguous()}

    def read_back_(self) -> None:
        """Replace the source (a float tensor or a view of one) in place by what loading the stored
        tensors gives: FP8 and MXFP4 weights quantised and dequantised, bfloat16 ones rounded."""
        w = self.source
        if self.fmt == "fp8":
            w.copy_(dequant_fp8_block(*quant_fp8_block(w)))
        elif self.fmt == "fp4":
            w.copy_(unpack_mxfp4(*quant_mxfp4(w)))
        elif self.fmt == "bf16":
            w.copy_(w.to(torch.bfloat16))


def _format_of(official: str) -> str:
    if official in _F32_GLOBAL_NAMES:
        return "f32"
    layer_part = official.split(".", 2)[2] if official.startswith("layers.") else ""
    if layer_part in _FP8_LAYER_NAMES:
        return "fp8"
    if layer_part in _F32_LAYER_NAMES:
        return "f32"
    if layer_part in _I32_LAYER_NAMES:
        return "i32"
    return "bf16"


def _expert_units(layer: str, kind: str, merged: Tensor, first_expert: int = 0) -> list[_Unit]:
    """`gate_up_proj [E, 2I, D]` → per-expert w1 `[I, D]` and w3; `down_proj [E, D, I]` → w2; row e
    is expert `first_expert + e`."""
    units = []
    n_experts, rows, _ = merged.shape
    half = rows // 2
    for e in range(n_experts):
        pieces = {"w2": (0, rows)} if kind == "down_proj" else {"w1": (0, half), "w3": (half, rows)}
        for proj, (lo, hi) in pieces.items():
            name = f"layers.{layer}.ffn.experts.{first_expert + e}.{proj}.weight"
            units.append(_Unit(name, "fp4", merged[e, lo:hi]))
    return units


def _units(hf_state_dict: Mapping[str, Tensor]) -> list[_Unit]:
    units: list[_Unit] = []
    unknown = []
    for name, tensor in hf_state_dict.items():
        official = _HF_GLOBAL.get(name)
        m = _HF_LAYER_RE.match(name)
        if official is None and m:
            if (e := _HF_EXPERTS_RE.match(m.group(2))) is not None:
                units += _expert_units(m.group(1), e.group(1), tensor)
                continue
            if m.group(2) in _HF_LAYER:
                official = f"layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}"
        if official is None:
            unknown.append(name)
            continue
        units.append(_Unit(official, _format_of(official), tensor))
    if unknown:
        raise ValueError(f"no release name for {len(unknown)} tensor(s): {', '.join(unknown[:20])}")
    return units


def _shards(units: list[_Unit], shard_size_bytes: int | None) -> list[list[_Unit]]:
    if not shard_size_bytes:
        return [units]
    shards: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if shards[-1] and size + unit.nbytes > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _config_dict(hf_config: Any) -> dict[str, Any]:
    cfg = hf_config.to_diff_dict()
    cfg.update(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        dtype="bfloat16",
        quantization_config=dict(QUANTIZATION_CONFIG),
        expert_dtype=EXPERT_DTYPE,
    )
    return cfg


def save_release_checkpoint(
    hf_state_dict: Mapping[str, Tensor],
    hf_config: Any,
    out_dir: str | Path,
    *,
    mtp_state_dict: Mapping[str, Tensor] | None = None,
    shard_size_bytes: int | None = None,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write `hf_state_dict` (in-memory transformers names, any float dtype) in the release layout.

    hf_config: the `DeepseekV4Config`; written to config.json with the release `quantization_config`
        and `expert_dtype: "fp4"`.
    mtp_state_dict: `mtp.*` tensors written verbatim (name and dtype as given).
    shard_size_bytes: split into `model-0000i-of-0000N.safetensors` plus an index when set; a weight and
        its scale stay in one shard.
    tokenizer_dir: tokenizer / generation-config files found there are copied alongside.
    Returns `out_dir`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    units = _units(hf_state_dict)
    for name, tensor in (mtp_state_dict or {}).items():
        if not is_mtp_name(name):
            raise ValueError(f"MTP tensor name must start with 'mtp.': {name}")
        units.append(_Unit(name, "raw", tensor))
    shards = _shards(units, shard_size_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = _shard_name(i, len(shards))
        tensors: dict[str, Tensor] = {}
        for unit in shard:
            tensors.update(unit.tensors())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
    _write_index_and_config(out, len(shards), weight_map, total, hf_config, tokenizer_dir)
    return out


def _write_index_and_config(out: Path, num_shards: int, weight_map: Mapping[str, str], total: int,
                            hf_config: Any, tokenizer_dir: str | Path | None) -> None:
    """The shard index (when there are several shards), config.json and the tokenizer's files."""
    if num_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(_config_dict(hf_config), indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        for fname in _TOKENIZER_FILES:
            if (Path(tokenizer_dir) / fname).is_file():
                shutil.copy2(Path(tokenizer_dir) / fname, out / fname)


# ---------------------------------------------------------------- writing tensor by tensor


def release_tensors(hf_name: str, value: Tensor) -> dict[str, Tensor]:
    """One in-memory tensor (transformers name, not a merged expert tensor) as the release stores
    it: official name → stored tensor(s), the weight and its `.scale` for quantised formats."""
    if _HF_LAYER_RE.match(hf_name) and _HF_EXPERTS_RE.match(hf_name.split(".", 3)[3]):
        raise ValueError(f"{hf_name}: merged experts are written with expert_block_tensors")
    return {name: t for unit in _units({hf_name: value}) for name, t in unit.tensors().items()}


def expert_block_tensors(layer: int, first_expert: int, gate_up: Tensor, down: Tensor) -> dict[str, Tensor]:
    """Routed experts `first_expert ..` of `layer` (gate_up `[n, 2I, D]`, down `[n, D, I]`, any float
    dtype) as the release stores them: per expert w1 / w3 / w2 MXFP4 codes and `.scale`s."""
    units = (_expert_units(str(layer), "gate_up_proj", gate_up, first_expert)
             + _expert_units(str(layer), "down_proj", down, first_expert))
    return {name: t for unit in units for name, t in unit.tensors().items()}


class ReleaseShardWriter:
    """A release-layout checkpoint written as its tensors arrive: `add` stored tensors (a weight
    and its scale in one call, so they share a shard); a shard is written once it holds
    `shard_size_bytes`, so at most one shard's tensors are held (on the CPU) at a time; `finish`
    names the shards `model-0000i-of-0000N`, writes the index, config.json and tokenizer files."""

    def __init__(self, out_dir: str | Path, shard_size_bytes: int) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_size_bytes = shard_size_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: Mapping[str, Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + size > self.shard_size_bytes:
            self._flush()
        self.pending.update({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
        self.pending_bytes += size

    def _flush(self) -> None:
        if not self.pending:
            return
        part = self.out / f"part-{len(self.parts):05d}.safetensors.tmp"
        save_file(self.pending, str(part), metadata={"format": "pt"})
        self.parts.append((part, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self, hf_config: Any, tokenizer_dir: str | Path | None = None) -> Path:
        self._flush()
        weight_map: dict[str, str] = {}
        for i, (part, names) in enumerate(self.parts):
            fname = _shard_name(i, len(self.parts))
            part.rename(self.out / fname)
            weight_map.update(dict.fromkeys(names, fname))
        _write_index_and_config(self.out, len(self.parts), weight_map, self.total_bytes, hf_config,
                                tokenizer_dir)
        return self.out


# An MTP block's own tensors (official names after `mtp.{i}.`): its two input projections are FP8
# linears in the release, its head mixing float32, its norms bfloat16.
MTP_FP8_NAMES = frozenset({"e_proj.weight", "h_proj.weight"})


def mtp_release_tensors(
    index: int, layer_state: Mapping[str, Tensor], own_state: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """MTP block `index` as the release stores it: `mtp.{index}.*` names -> stored tensors (weights and
    `.scale`s), formats as the target's layers (FP8 linears, MXFP4 experts, float32 mixing).

    layer_state: the block's decoder layer under in-memory names relative to the layer
        (`self_attn.q_a_proj.weight`, `mlp.experts.gate_up_proj`, `attn_hc.fn`, ...);
    own_state: the block's own tensors under their official names (`e_proj.weight`, `enorm.weight`,
        `hc_head_fn`, ...)."""
    out: dict[str, Tensor] = {}
    for unit in _mtp_units(index, layer_state, own_state):
        out.update(unit.tensors())
    return out


def mtp_read_back_(layer_state: Mapping[str, Tensor], own_state: Mapping[str, Tensor]) -> None:
    """Each float tensor of an MTP block's state (arguments as `mtp_release_tensors`'s) replaced in
    place by the value the block serves with once written in the release's formats and read back."""
    for unit in _mtp_units(0, layer_state, own_state):
        unit.read_back_()


def _mtp_units(
    index: int, layer_state: Mapping[str, Tensor], own_state: Mapping[str, Tensor]
) -> list[_Unit]:
    units = [
        _Unit(f"mtp.{unit.name.removeprefix('layers.')}", unit.fmt, unit.source)
        for unit in _units({f"model.layers.{index}.{name}": t for name, t in layer_state.items()})
    ]
    for name, tensor in own_state.items():
        fmt = "fp8" if name in MTP_FP8_NAMES else "f32" if name in _F32_GLOBAL_NAMES else "bf16"
        units.append(_Unit(f"mtp.{index}.{name}", fmt, tensor))
    return units
