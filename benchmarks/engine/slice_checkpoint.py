"""Write the V4-Flash 4-layer slice (random weights) to disk as a release-layout checkpoint.

The slice of `lib/slices.SliceSpec` (hidden 4096, 64 heads x 512, layers sliding / CSA / HCA /
CSA, 16 routed experts): weights drawn on the device, linears rounded through the release's FP8
blocks and experts through MXFP4 so the release layout stores them exactly, then written with
`save_release_checkpoint` (FP8 e4m3 + UE8M0 linears, MXFP4 experts) in 2 GB shards beside the
V4 tokenizer, so `antumbra serve --model DIR --device cuda` can serve it.

    python -m benchmarks.engine.slice_checkpoint OUT_DIR [--smoke] [--mtp]

The GPU benchmarks that serve the slice (cold starts, the platform against the engine) write it
once to `.cache/v4-slice` (`cached_slice`).

With an MTP block (`--mtp`; `.cache/v4-slice-mtp`, which speculative decoding serves): the same target
(the same weights: the block is drawn from a generator of its own) with `num_nextn_predict_layers: 1`
and one draft block in the release's names and formats, drawn like the target's tensors and then
distilled on the device on the target's own greedy text (`antumbra.rl.mtp_distill`, in the serving
dtype, `distill_config`). The random slice's greedy text repeats itself a lot; that is no matter: the
block is trained to predict what this target says, which is what its drafts are judged by.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..lib.slices import SMOKE_SLICE, SliceSpec, build_hf, random_mtp_block
from ..lib.tree_hash import ROOT

# The draft block's generator, apart from the target's (seed 0), so the target is v4-slice's.
MTP_SEED = 0x4D5450
# What writing an MTP slice recorded (`write_slice_checkpoint`'s dict), written last: its presence
# says the checkpoint is whole.
RECORD_FILE = "written.json"


def distill_config(device: str, smoke: bool, continuation: int | None = None) -> Any:
    """The slice's distillation (`DistillConfig`), sized for a minute or so of one GPU: 128 prompts of
    32 random tokens from the whole vocabulary (or the prompts given to `cached_slice`) continued
    greedily by 96 (or `continuation`) tokens, then 300 steps of 8 sequences in bfloat16 with float32
    master weights.
    The rate is a tenth of the tiny target's: Adam moves every weight by about the rate a step, and at
    width 4096 the fan-in weights are near 0.016, a tenth of the tiny ones. --smoke: a few steps on a
    few short sequences, float32 on the CPU."""
    from antumbra.rl.mtp_distill import DistillConfig

    if smoke:
        return DistillConfig(num_prompts=4, prompt_tokens=16, continuation_tokens=continuation or 8, steps=3,
                             batch_size=2, device=device)
    spec = SliceSpec()
    return DistillConfig(num_prompts=128, prompt_tokens=32, continuation_tokens=continuation or 96, steps=300,
                         batch_size=8, learning_rate=3e-4, token_range=(2, spec.vocab_size), device=device,
                         dtype="bfloat16" if device.startswith("cuda") else "float32")


def distill_key(prompts: list[list[int]] | None, continuation: int | None, config: Any,
                continuations: list[list[int]] | None = None) -> str:
    """What a distillation was given and how it ran (its `DistillConfig`), as a short hash: which cached
    MTP slice fits a run."""
    text = json.dumps([prompts, continuation, dataclasses.asdict(config), continuations])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def write_slice_checkpoint(out_dir: Path, spec: SliceSpec, device: str, mtp: bool = False,
                           smoke: bool = False, prompts: list[list[int]] | None = None,
                           continuation: int | None = None,
                           continuations: list[list[int]] | None = None) -> dict[str, Any]:
    """-> {"seconds", "bytes"} of writing the slice at `out_dir`; with `mtp` also a random MTP block,
    distilled (`distill_config(device, smoke, continuation)`, on `prompts` when given, continued by
    `continuations` when given, else by the distillation's own greedy run), and "distill":
    {"first_loss", "last_loss", "trained_loss", "master_loss", "written_loss", "seconds", "phases",
    "config", "key"}."""
    from antumbra.replicas.model.release_format import save_release_checkpoint
    from antumbra.replicas.model.tokenizer import save_tokenizer
    from antumbra.replicas.speculative.mtp_loading import write_mtp
    from antumbra.rl.mtp_distill import distill

    started = time.monotonic()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = build_hf(spec, device, dtype, mtp_layers=1 if mtp else 0)
    with tempfile.TemporaryDirectory() as tok:
        save_tokenizer(tok, model_max_length=hf.config.max_position_embeddings)
        save_release_checkpoint(
            hf.state_dict(), hf.config, out_dir, shard_size_bytes=2 << 30, tokenizer_dir=tok
        )
    if mtp:
        write_mtp(out_dir, [random_mtp_block(hf.config, spec.n_routed_experts, device, MTP_SEED)])
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))
    record: dict[str, Any] = {"seconds": time.monotonic() - started, "bytes": float(size)}
    if mtp:
        config = distill_config(device, smoke, continuation)
        result = distill(out_dir, config, prompts, continuations)
        if device == "cuda":
            torch.cuda.empty_cache()
        # Over every sequence after training: the block as its last step ran it, the unrounded masters,
        # and the block as written (what the drafter serves with).
        losses = {"trained_loss": result.trained_loss, "master_loss": result.master_loss,
                  "written_loss": result.written_loss}
        record["distill"] = {"first_loss": result.first_loss, "last_loss": result.last_loss, **losses,
                             "seconds": result.seconds, "phases": result.phases,
                             "config": dataclasses.asdict(config), "on_given_prompts": prompts is not None,
                             "on_given_text": continuations is not None,
                             "key": distill_key(prompts, continuation, config, continuations)}
    return record


def cached_slice(device: str, smoke: bool, mtp: bool = False, prompts: list[list[int]] | None = None,
                 continuation: int | None = None, continuations: list[list[int]] | None = None) -> Path:
    """The slice checkpoint under `.cache/` (git-ignored), written on first use; `mtp`: the slice with
    an MTP block distilled on `prompts` continued by `continuation` tokens (None: `distill_config`'s;
    `continuations`: these tokens, the served engine's text),
    written again when the cached one was distilled on others (`written_record` tells how its writing
    and distillation went)."""
    out = ROOT / ".cache" / ("v4-slice" + ("-mtp" if mtp else "") + ("-smoke" if smoke else ""))
    if not mtp:
        if not (out / "config.json").exists():
            write_slice_checkpoint(out, SMOKE_SLICE if smoke else SliceSpec(), device)
        return out
    key = distill_key(prompts, continuation, distill_config(device, smoke, continuation), continuations)
    if written_record(out).get("distill", {}).get("key") != key:
        shutil.rmtree(out, ignore_errors=True)  # another distillation's, or one cut short
        record = write_slice_checkpoint(out, SMOKE_SLICE if smoke else SliceSpec(), device, True, smoke,
                                        prompts, continuation, continuations)
        (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return out


def written_record(path: Path) -> dict[str, Any]:
    """What writing the MTP slice at `path` recorded ({} for a slice without one)."""
    file = path / RECORD_FILE
    return json.loads(file.read_text()) if file.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="small widths (CPU)")
    parser.add_argument("--mtp", action="store_true", help="with an MTP block, distilled on the device")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(write_slice_checkpoint(args.out_dir, SMOKE_SLICE if args.smoke else SliceSpec(), device, args.mtp,
                                 args.smoke))


if __name__ == "__main__":
    main()
