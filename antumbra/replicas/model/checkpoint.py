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
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors import safe_open
from torch import Tensor, nn
from tqdm import tqdm

from antumbra.replicas.model.quant import (
    FP8_BLOCK,
    MXFP4_BLOCK,
    dequant_fp8_block,
    fp8_scale_shape,
    unpack_mxfp4,
)

if TYPE_CHECKING:
    from transformers import DeepseekV4Config

Layout = Literal["hf", "release"]
Expected = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_MAX_LISTED = 20
_PROGRESS_MIN_BYTES = 1 << 30

# ---------------------------------------------------------------------------------------------------------
# Official (release) names ↔ transformers in-memory names.

GLOBAL_RENAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def _layer_renames() -> dict[str, str]:
    """Per-layer renames, keyed by the name after `layers.L.` (official) → after `model.layers.L.`."""
    renames = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn.attn_sink": "self_attn.sinks",
        "attn.wq_a.weight": "self_attn.q_a_proj.weight",
        "attn.q_norm.weight": "self_attn.q_a_norm.weight",
        "attn.wq_b.weight": "self_attn.q_b_proj.weight",
        "attn.wkv.weight": "self_attn.kv_proj.weight",
        "attn.norm.weight": "self_attn.kv_norm.weight",
        "attn.wo_a.weight": "self_attn.o_a_proj.weight",
        "attn.wo_b.weight": "self_attn.o_b_proj.weight",
        "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
        "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
        "ffn.gate.weight": "mlp.gate.weight",
        "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
        "ffn.gate.tid2eid": "mlp.gate.tid2eid",
        "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
        "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    }
    for branch in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            renames[f"hc_{branch}_{part}"] = f"{branch}_hc.{part}"
    for official, hf in (("attn.compressor", "self_attn.compressor"),
                         ("attn.indexer.compressor", "self_attn.compressor.indexer")):
        renames[f"{official}.wkv.weight"] = f"{hf}.kv_proj.weight"
        renames[f"{official}.wgate.weight"] = f"{hf}.gate_proj.weight"
        renames[f"{official}.norm.weight"] = f"{hf}.kv_norm.weight"
        renames[f"{official}.ape"] = f"{hf}.position_bias"
    return renames


LAYER_RENAMES: dict[str, str] = _layer_renames()

# Routed-expert pieces: w1 (gate) and w3 (up) stack into gate_up_proj, w2 (down) is down_proj.
EXPERT_TARGETS = {"w1": "gate_up_proj", "w2": "down_proj", "w3": "gate_up_proj"}
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.w([123])\.weight$")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^(model\.)?mtp\.")


def is_mtp_name(name: str) -> bool:
    return _MTP_RE.match(name) is not None


def official_to_hf(name: str) -> str | None:
    """Official release name (no prefix, not an expert piece) → in-memory name, or None if unknown."""
    if name in GLOBAL_RENAMES:
        return GLOBAL_RENAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in LAYER_RENAMES:
        return f"model.layers.{m.group(1)}.{LAYER_RENAMES[m.group(2)]}"
    return None


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert matrix goes inside a merged expert tensor."""

    layer: int
    expert: int
    proj: str  # "w1" | "w2" | "w3"

    @property
    def target(self) -> str:
        return f"model.layers.{self.layer}.mlp.experts.{EXPERT_TARGETS[self.proj]}"

    def rows(self, merged_shape: tuple[int, ...]) -> slice:
        """Row range of this piece in the merged `[E, rows, cols]` tensor."""
        if self.proj == "w2":
            return slice(0, merged_shape[1])
        half = merged_shape[1] // 2
        return slice(0, half) if self.proj == "w1" else slice(half, 2 * half)

    def piece_shape(self, merged_shape: tuple[int, ...]) -> tuple[int, int]:
        r = self.rows(merged_shape)
        return (r.stop - r.start, merged_shape[2])


def _classify(name: str) -> str | ExpertSlot:
    """Checkpoint weight name (not a scale, not mtp) → in-memory name or expert slot."""
    bare = name.removeprefix("model.")
    m = _EXPERT_RE.match(bare)
    if m:
        return ExpertSlot(int(m.group(1)), int(m.group(2)), f"w{m.group(3)}")
    hf = official_to_hf(bare)
    if hf is not None:
        return hf
    return bare if bare.startswith("lm_head.") else f"model.{bare}"


# ---------------------------------------------------------------------------------------------------------
# Errors, config, layout.


class CheckpointError(ValueError):
    """The checkpoint does not match the model; `problems` lists every offending tensor."""

    def __init__(self, path: Path | str, problems: Iterable[str]):
        self.problems = tuple(problems)
        shown = "\n  ".join(self.problems[:_MAX_LISTED])
        more = len(self.problems) - _MAX_LISTED
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"checkpoint {path}: {len(self.problems)} problem(s)\n  {shown}{tail}")


def load_hf_config(path: str | Path) -> DeepseekV4Config:
    """`config.json` of a checkpoint directory → `transformers.DeepseekV4Config`."""
    from transformers import DeepseekV4Config

    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type != "deepseek_v4":
        raise ValueError(f"{cfg_file}: model_type is {model_type!r}, expected 'deepseek_v4'")
    return DeepseekV4Config.from_pretrained(str(path))


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → file, from the shard index or by listing every `.safetensors` file."""
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        weight_map: dict[str, str] = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise CheckpointError(path, [f"shard listed in {INDEX_FILE} is missing: {f}" for f in absent])
        return {name: path / f for name, f in weight_map.items()}
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    out: dict[str, Path] = {}
    duplicates = []
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for name in fh.keys():
                if name in out:
                    duplicates.append(f"duplicate tensor {name} in {out[name].name} and {file.name}")
                out[name] = file
    if duplicates:
        raise CheckpointError(path, duplicates)
    return out


def _layout_of(names: Iterable[str]) -> Layout:
    # `head.weight` is unprefixed in both layouts, so only the layer and embedding names tell them apart.
    for name in names:
        if not is_mtp_name(name) and (name.startswith("layers.") or name == "embed.weight"):
            return "release"
    return "hf"


def detect_layout(path: str | Path) -> Layout:
    """`"release"` for official unprefixed names (`layers.0.attn.wq_a.weight`), else `"hf"`."""
    return _layout_of(_weight_files(Path(path)))


# ---------------------------------------------------------------------------------------------------------
# Planning: match every stored tensor to its target from header metadata only, before reading data.

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2}


@dataclass(frozen=True)
class _Stored:
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPE_BYTES.get(self.dtype, 1)


@dataclass(frozen=True)
class _Item:
    """One stored weight (plus its scale) and where its dequantised value goes."""

    weight: _Stored
    scale: _Stored | None
    target: str
    slot: ExpertSlot | None = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)


@dataclass
class _Plan:
    items: list[_Item] = field(default_factory=list)
    mtp: list[_Stored] = field(default_factory=list)
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
    weight: _Stored, scale: _Stored | None, block: int
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
    kind = _classify(name)
    target = kind.target if isinstance(kind, ExpertSlot) else kind
    if target not in expected:
        return f"unexpected tensor {name} {shape} (would load as {target})"
    want = tuple(expected[target][0])
    if not isinstance(kind, ExpertSlot):
        return _Target(target, target, want, None)
    if len(want) != 3 or kind.expert >= want[0]:
        return f"unexpected tensor {name}: expert {kind.expert} beyond {target} {want}"
    return _Target(target, f"{target}[expert {kind.expert} {kind.proj}]", kind.piece_shape(want), kind)


def _plan(stored: Mapping[str, _Stored], expected: Expected, block: int) -> _Plan:
    plan = _Plan()
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
        plan.items.append(_Item(info, scale, target.name, target.slot))
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


# ---------------------------------------------------------------------------------------------------------
# Loading.


@dataclass(frozen=True)
class LoadedCheckpoint:
    """state_dict: in-memory names → tensors (floating ones in the requested dtype, integer ones in the
    expected dtype). mtp_state_dict: the `mtp.*` tensors under their stored names and dtypes.
    layout: `"hf"` or `"release"`."""

    state_dict: dict[str, Tensor]
    mtp_state_dict: dict[str, Tensor]
    layout: Layout


def expected_from_module(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """`module.state_dict()` → `{name: (shape, dtype)}` (works on meta-device modules)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def hf_expected(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected names, shapes and dtypes of `DeepseekV4ForCausalLM(config)`, built on the meta device."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        return expected_from_module(DeepseekV4ForCausalLM(config))


def _fp8_block_size(path: Path) -> int:
    """Square FP8 block from `quantization_config.weight_block_size` (128 when absent)."""
    cfg_file = (path if path.is_dir() else path.parent) / CONFIG_FILE
    if not cfg_file.is_file():
        return FP8_BLOCK
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    block = qcfg.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
    if len(set(block)) != 1:
        raise ValueError(f"{cfg_file}: only square FP8 blocks are supported, got {block}")
    return int(block[0])


def _read_metadata(handles: Mapping[Path, Any], files: Mapping[str, Path]) -> dict[str, _Stored]:
    out = {}
    for name, file in files.items():
        sl = handles[file].get_slice(name)
        out[name] = _Stored(name, file, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _dequantise(weight: Tensor, scale: Tensor | None, block: int) -> Tensor:
    """Stored weight (+ scale) → float32 for quantised pairs, else the tensor unchanged."""
    if scale is None:
        return weight
    if weight.dtype in (torch.int8, torch.uint8):
        return unpack_mxfp4(weight, scale)
    return dequant_fp8_block(weight, scale, block)


def _out_dtype(expected_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    if not expected_dtype.is_floating_point or dtype is None:
        return expected_dtype
    return dtype


def _in_file_order(items: list[_Item]) -> Iterator[_Item]:
    # Reading shard by shard keeps the page cache and disk access sequential.
    yield from sorted(items, key=lambda it: (str(it.weight.file), it.weight.name))


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
) -> LoadedCheckpoint:
    """Load a checkpoint directory (or one `.safetensors` file) in either layout.

    expected: in-memory name → (shape, dtype) of every tensor the model needs, e.g.
        `expected_from_module(model)` or `hf_expected(config)`.
    dtype: dtype of every floating tensor in the result (None: each tensor's expected dtype). Integer
        tensors (`tid2eid`) take their expected dtype.
    Raises CheckpointError naming every missing, unexpected, duplicated or misshapen tensor before any
    tensor data is read. Tensors are read lazily one at a time; merged expert tensors are allocated
    once and filled piece by piece.
    """
    path = Path(path)
    files = _weight_files(path)
    block = _fp8_block_size(path)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in sorted(set(files.values()))}
        stored = _read_metadata(handles, files)
        plan = _plan(stored, expected, block)
        if plan.problems:
            raise CheckpointError(path, plan.problems)
        total = sum(it.nbytes for it in plan.items) + sum(s.nbytes for s in plan.mtp)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
                   disable=not _show_progress(progress, total))
        with bar:
            state = _load_items(plan.items, handles, expected, dtype, torch.device(device), block, bar)
            mtp = {}
            for info in plan.mtp:
                mtp[info.name] = handles[info.file].get_tensor(info.name).to(device)
                bar.update(info.nbytes)
    return LoadedCheckpoint(state_dict=state, mtp_state_dict=mtp, layout=_layout_of(files))


def _load_items(
    items: list[_Item],
    handles: Mapping[Path, Any],
    expected: Expected,
    dtype: torch.dtype | None,
    device: torch.device,
    block: int,
    bar: tqdm,
) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for item in _in_file_order(items):
        fh = handles[item.weight.file]
        weight = fh.get_tensor(item.weight.name).to(device)
        scale = handles[item.scale.file].get_tensor(item.scale.name).to(device) if item.scale else None
        shape, want_dtype = expected[item.target]
        value = _dequantise(weight, scale, block).to(_out_dtype(want_dtype, dtype))
        if item.slot is None:
            state[item.target] = value
        else:
            if item.target not in state:
                state[item.target] = torch.empty(shape, dtype=value.dtype, device=device)
            state[item.target][item.slot.expert, item.slot.rows(shape)].copy_(value)
        bar.update(item.nbytes)
    # Preserve the model's key order so `state_dict` iterates like `module.state_dict()`.
    return {k: state[k] for k in expected}
