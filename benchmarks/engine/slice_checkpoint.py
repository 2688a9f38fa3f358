"""Write the V4-Flash 4-layer slice (random weights) to disk as a release-layout checkpoint.

The slice of `lib/slices.SliceSpec` (hidden 4096, 64 heads x 512, layers sliding / CSA / HCA /
CSA, 16 routed experts): weights drawn on the device, linears rounded through the release's FP8
blocks and experts through MXFP4 so the release layout stores them exactly, then written with
`save_release_checkpoint` (FP8 e4m3 + UE8M0 linears, MXFP4 experts) in 2 GB shards beside the
V4 tokenizer, so `antumbra serve --model DIR --device cuda` can serve it.

    python -m benchmarks.engine.slice_checkpoint OUT_DIR [--smoke]

The GPU benchmarks that serve the slice (cold starts, the platform against the engine) write it
once to `.cache/v4-slice` (`cached_slice`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ..lib.slices import SMOKE_SLICE, SliceSpec, build_hf
from ..lib.tree_hash import ROOT


def write_slice_checkpoint(out_dir: Path, spec: SliceSpec, device: str) -> dict[str, float]:
    """-> {"seconds", "bytes"} of writing the slice at `out_dir`."""
    from antumbra.replicas.model.release_format import save_release_checkpoint
    from antumbra.replicas.model.tokenizer import save_tokenizer

    started = time.monotonic()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = build_hf(spec, device, dtype)
    with tempfile.TemporaryDirectory() as tok:
        save_tokenizer(tok, model_max_length=hf.config.max_position_embeddings)
        save_release_checkpoint(
            hf.state_dict(), hf.config, out_dir, shard_size_bytes=2 << 30, tokenizer_dir=tok
        )
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))
    return {"seconds": time.monotonic() - started, "bytes": float(size)}


def cached_slice(device: str, smoke: bool) -> Path:
    """The slice checkpoint under `.cache/` (git-ignored), written on first use."""
    out = ROOT / ".cache" / ("v4-slice-smoke" if smoke else "v4-slice")
    if not (out / "config.json").exists():
        write_slice_checkpoint(out, SMOKE_SLICE if smoke else SliceSpec(), device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="small widths (CPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(write_slice_checkpoint(args.out_dir, SMOKE_SLICE if args.smoke else SliceSpec(), device))


if __name__ == "__main__":
    main()
