"""Write the real-MoE slice (V4-Flash's 256 routed experts, random weights) as a release-layout
checkpoint, never holding one layer's experts at once.

The slice (`lib/slices.REAL_MOE_SLICE`): V4-Flash's widths and MoE (256 routed experts + 1 shared,
top-6, intermediate 2048, layers 0-2 hash-routed through `tid2eid`, layer 3 score-routed) on four
layers (sliding / CSA / HCA / CSA). transformers' model would hold every expert in the model dtype
(12.9 GB a layer in bf16), so the weights are drawn tensor by tensor instead: each non-expert
tensor alone, the routed experts `EXPERTS_PER_BLOCK` at a time (float32 on the device: 3 x 268 MB
for 8 experts), each rounded to its release format as it is stored (FP8 blocks, MXFP4) and handed
to a `ReleaseShardWriter` whose shards hold `SHARD_BYTES`. Peak memory: one block of experts in
float32 on the device, one shard (about five blocks' stored bytes) on the host.

Why four layers. Per V4-Flash layer: routed experts 256 x 3 x 2048 x 4096 = 6.44 G params, in
MXFP4 0.53125 bytes a param (4-bit codes + one UE8M0 scale per 32) = 3.42 GB; attention, indexer,
compressors and the shared expert in FP8 about 0.15 GB. Embedding and head (129280 x 4096 bf16):
2.1 GB. B64 at 16K of exact-numerics bf16 KV: per sequence and layer 128 KiB of SWA rows, CSA
16384 / 4 x (1024 + 256) B = 5.2 MB, HCA 16384 / 128 x 1024 B = 0.13 MB, so 64 x (4 x 0.13 +
2 x 5.2 + 0.13) MB = 0.71 GB for four layers. Served packed, L layers need about 3.6 L + 2.1 GB
plus pools, graphs and the 8.6 GB copy probe: some 35 layers would fit in an H200 (about 140 GiB).
`Engine.from_pretrained` reads the experts of an engine that serves them packed straight from their
MXFP4 codes (`replicas/model/checkpoint_packed.py`), so the load needs the packed bytes, about 17 GB
for four layers, and the slice also loads on an 80 GB H100. (Before, the load filled each layer's
merged expert tensors in bf16, 12.9 GB a layer, and peaked near 108 GB for four layers.) Four layers
it stays, one of each attention kind as the slice: they write 14 GB to disk and load within one timed
call, and each further layer adds 3.6 GB to write.

    python -m benchmarks.engine.real_moe_checkpoint OUT_DIR [--smoke]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..lib.slices import REAL_MOE_SLICE, SMOKE_REAL_MOE, SliceSpec, draw, hf_config
from ..lib.tree_hash import ROOT

if TYPE_CHECKING:
    from antumbra.replicas.model.release_format import ReleaseShardWriter

EXPERTS_PER_BLOCK = 8
SHARD_BYTES = 512 << 20
_EXPERT_TENSORS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


@torch.no_grad()
def write_real_moe_checkpoint(out_dir: Path, spec: SliceSpec, device: str, seed: int = 0) -> dict[str, float]:
    """-> {"seconds", "bytes", "peak_device_bytes"} of writing the slice at `out_dir`."""
    from antumbra.replicas.model.checkpoint import hf_expected
    from antumbra.replicas.model.release_format import ReleaseShardWriter, release_tensors
    from antumbra.replicas.model.tokenizer import save_tokenizer

    started = time.monotonic()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    config = hf_config(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    writer = ReleaseShardWriter(out_dir, SHARD_BYTES)
    for name, (shape, _dtype) in hf_expected(config).items():
        if name.endswith(_EXPERT_TENSORS):
            continue
        writer.add(release_tensors(name, draw(name, shape, gen, device, spec.n_routed_experts)))
    for layer in range(len(spec.layer_types)):
        _write_experts(writer, spec, layer, gen, device)
    with tempfile.TemporaryDirectory() as tok:
        save_tokenizer(tok, model_max_length=config.max_position_embeddings)
        writer.finish(config, tokenizer_dir=tok)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
    return {"seconds": time.monotonic() - started, "bytes": float(writer.total_bytes),
            "peak_device_bytes": float(peak)}


def _write_experts(writer: ReleaseShardWriter, spec: SliceSpec, layer: int, gen: torch.Generator,
                   device: str) -> None:
    """Layer `layer`'s routed experts, a block at a time, drawn as `lib/slices.draw` draws the merged
    tensors (normal, 1 / sqrt(fan-in))."""
    from antumbra.replicas.model.release_format import expert_block_tensors

    hidden, inter = spec.hidden_size, spec.moe_intermediate_size
    for first in range(0, spec.n_routed_experts, EXPERTS_PER_BLOCK):
        n = min(EXPERTS_PER_BLOCK, spec.n_routed_experts - first)
        gate_up = torch.randn((n, 2 * inter, hidden), generator=gen, device=device) / math.sqrt(hidden)
        down = torch.randn((n, hidden, inter), generator=gen, device=device) / math.sqrt(inter)
        writer.add(expert_block_tensors(layer, first, gate_up, down))
        del gate_up, down


def cached_real_moe(device: str, smoke: bool) -> Path:
    """The real-MoE checkpoint under `.cache/` (git-ignored), written on first use."""
    out = ROOT / ".cache" / ("v4-real-moe-smoke" if smoke else "v4-real-moe")
    if not (out / "config.json").exists():
        write_real_moe_checkpoint(out, SMOKE_REAL_MOE if smoke else REAL_MOE_SLICE, device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="small widths, 16 experts (CPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(write_real_moe_checkpoint(args.out_dir, SMOKE_REAL_MOE if args.smoke else REAL_MOE_SLICE, device))


if __name__ == "__main__":
    main()
