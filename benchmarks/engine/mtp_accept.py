"""What a distilled MTP draft block buys: its accept length at k = 1, 3, 5 with the reference decoder.

A tiny checkpoint's random MTP block is distilled on the target's own greedy continuations
(`antumbra.rl.mtp_distill`), written back in the release format and read again; then held-aside
prompts are decoded greedily with `speculative_decode`, whose output equals plain greedy decoding.
Accept length = tokens emitted per target verify step, the correction / bonus token included (1.0:
every draft rejected; k + 1: every draft accepted). Also recorded: the random block's accept length
(what distillation starts from) and the distillation loss: of its first and last steps, and over every
sequence after training, of the block as it trained, of its unrounded masters and as written.

    python -m benchmarks run engine --only mtp_accept [--smoke]

`--set steps=N` overrides the number of distillation steps.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ..lib.context import Context

DEVICE = "cpu"
KS = (1, 3, 5)


def _accept_lengths(path: Path, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    from antumbra.replicas.build import load_model
    from antumbra.replicas.speculative.mtp_loading import load_mtp
    from antumbra.replicas.speculative.reference import speculative_decode

    model = load_model(path, "cpu", torch.float32, progress=False).model
    block = load_mtp(path)
    out = {}
    for k in KS:
        runs = [speculative_decode(model, block, p, new_tokens, k) for p in prompts]
        emitted = sum(r.accepted + r.verify_steps for r in runs)
        out[f"k{k}"] = emitted / sum(r.verify_steps for r in runs)
    return out


def run(ctx: Context) -> dict[str, Any]:
    from antumbra.replicas.model.tiny import make_tiny_checkpoint
    from antumbra.rl.mtp_distill import DISTILL_SPEC, DistillConfig, distill, random_prompts

    # Steps of a few hundred small ops each: one thread spends far less time waiting for the others.
    torch.set_num_threads(1)
    steps = ctx.option("steps", 4 if ctx.smoke else 400)
    config = DistillConfig(steps=steps, num_prompts=8 if ctx.smoke else 96)
    num_prompts, new_tokens = (1, 6) if ctx.smoke else (8, 48)
    used = DISTILL_SPEC.padded_vocab_start
    prompts = random_prompts(num_prompts, config.prompt_tokens, (2, used), seed=config.seed + 1)
    result: dict[str, Any] = {"steps": steps, "prompts": num_prompts, "new_tokens": new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny", DISTILL_SPEC, with_tokenizer=False)
        result["random_block"] = _accept_lengths(path, prompts, new_tokens)
        trained = distill(path, config)
        result["loss"] = {"first": trained.first_loss, "last": trained.last_loss,
                          "trained": trained.trained_loss, "masters": trained.master_loss,
                          "written": trained.written_loss}
        result["distilled_block"] = _accept_lengths(path, prompts, new_tokens)
    result["ratios"] = {f"mtp_tiny_accept_length_{k}": v for k, v in result["distilled_block"].items()}
    return result
