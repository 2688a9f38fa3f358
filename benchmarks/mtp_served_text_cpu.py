"""Whether a distilled MTP block drafts what the target serves: its accept length where it is served
otherwise than it was distilled.

The tiny distillation target on the CPU (`mtp_distill.DISTILL_SPEC`: random weights, a window of 8).
Its block is distilled (400 steps) on `PROMPTS` prompts continued greedily, once in float32 and once
in bfloat16, each time by an engine of that dtype (the text it learns is that engine's); each block
then drafts k = 3 through the reference decoder (float32) and through the engine served in float32,
in bfloat16 and in bfloat16 with the release's numerics, on the prompts it was distilled on and on
held-aside ones. Accept length = tokens per verify step, the correction / bonus token included
(4.0: every draft accepted).

A random target's logits are near ties, so rounding otherwise (another dtype, numerics mode or batch
shape) writes other text: the question is how much of a learnt text a block still drafts then. It
is the H200 benchmark's case (`engine/spec_decode.py`), whose block learnt the text of one batch
of every timed prompt and was timed at batches of 1, 8 and 32.

    python -m benchmarks.mtp_served_text_cpu   # -> benchmarks/results/mtp-served-text.json
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .lib.records import provenance, write_results

PROMPTS, PROMPT_TOKENS, NEW_TOKENS, STEPS, K = 8, 16, 40, 400, 3
SERVED = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
          "bfloat16_release": {"dtype": "bfloat16", "numerics": "release"}}


def _engine_accept(path: Path, settings: dict[str, str], prompts: list[list[int]]) -> float:
    from antumbra import Engine, SamplingParams

    engine = Engine.from_pretrained(path, device="cpu", speculative_tokens=K,
                                    speculative_max_batch=len(prompts), **settings)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    steps = sum(o.num_drafted_tokens for o in outs) / K
    return (sum(o.num_accepted_tokens for o in outs) + steps) / steps


def _reference_accept(path: Path, prompts: list[list[int]]) -> float:
    from antumbra.replicas.build import load_model
    from antumbra.replicas.speculative.mtp_loading import load_mtp
    from antumbra.replicas.speculative.reference import speculative_decode

    model = load_model(path, "cpu", torch.float32, progress=False).model
    runs = [speculative_decode(model, load_mtp(path), p, NEW_TOKENS, K) for p in prompts]
    return sum(r.accepted + r.verify_steps for r in runs) / sum(r.verify_steps for r in runs)


def one_dtype(root: Path, dtype: str) -> dict[str, Any]:
    """Distil in `dtype` on its own engine's text, then every accept length."""
    from antumbra.replicas.model.tiny import make_tiny_checkpoint
    from antumbra.rl.mtp_distill import DISTILL_SPEC, DistillConfig, distill, random_prompts

    path = make_tiny_checkpoint(root / dtype, DISTILL_SPEC, with_tokenizer=False)
    config = DistillConfig(num_prompts=PROMPTS, prompt_tokens=PROMPT_TOKENS, continuation_tokens=NEW_TOKENS,
                           steps=STEPS, dtype=dtype)
    span = (2, max(3, DISTILL_SPEC.vocab_size // 4))  # what `distill` draws its prompts from
    distilled_on = random_prompts(PROMPTS, PROMPT_TOKENS, span, config.seed)
    held_aside = random_prompts(PROMPTS // 2, PROMPT_TOKENS, span, config.seed + 1)
    result = distill(path, config)
    out: dict[str, Any] = {"written_loss": result.written_loss, "distill_s": result.seconds}
    for name, prompts in (("distilled_on", distilled_on), ("held_aside", held_aside)):
        engines = {f"engine_{s}": _engine_accept(path, settings, prompts) for s, settings in SERVED.items()}
        out[name] = {"reference_float32": _reference_accept(path, prompts), **engines}
        print(dtype, name, out[name], flush=True)
    return out


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        by_dtype = {dtype: one_dtype(Path(tmp), dtype) for dtype in ("float32", "bfloat16")}
    result: dict[str, Any] = {**provenance("cpu"), "k": K, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
                              "new_tokens": NEW_TOKENS, "distill_steps": STEPS,
                              "seconds": time.perf_counter() - started, "distilled_in": by_dtype}
    result["ratios"] = {
        f"accept_distilled_{d}_served_{s}": by_dtype[d]["distilled_on"][f"engine_{s}"]
        for d in by_dtype for s in SERVED
    }
    write_results("mtp-served-text.json", result)


if __name__ == "__main__":
    main()
