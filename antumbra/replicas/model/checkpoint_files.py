"""A checkpoint directory on disk: its `config.json`, its safetensors files, which layout it is in."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from safetensors import safe_open

from antumbra.replicas.model.checkpoint_names import is_mtp_name
from antumbra.replicas.model.quant import FP8_BLOCK

if TYPE_CHECKING:
    from transformers import DeepseekV4Config

Layout = Literal["hf", "release"]

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
_MAX_LISTED = 20


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


def weight_files(path: Path) -> dict[str, Path]:
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


def layout_of(names: Iterable[str]) -> Layout:
    # `head.weight` is unprefixed in both layouts, so only the layer and embedding names tell them apart.
    for name in names:
        if not is_mtp_name(name) and (name.startswith("layers.") or name == "embed.weight"):
            return "release"
    return "hf"


def detect_layout(path: str | Path) -> Layout:
    """`"release"` for official unprefixed names (`layers.0.attn.wq_a.weight`), else `"hf"`."""
    return layout_of(weight_files(Path(path)))


def fp8_block_size(path: Path) -> int:
    """Square FP8 block from `quantization_config.weight_block_size` (128 when absent)."""
    cfg_file = (path if path.is_dir() else path.parent) / CONFIG_FILE
    if not cfg_file.is_file():
        return FP8_BLOCK
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    block = qcfg.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
    if len(set(block)) != 1:
        raise ValueError(f"{cfg_file}: only square FP8 blocks are supported, got {block}")
    return int(block[0])
