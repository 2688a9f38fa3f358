"""What batch-invariant mode costs: the same batch in the default mode and with deterministic=True.

Eight prompts of 64-512 tokens, 32 sampled tokens each, run together on the tiny checkpoint on
the CPU, twice per mode (the first run warms up); decode tokens/s and end-to-end time of each.
On a CPU both modes run the PyTorch general step; the GPU figures (the fixed-shape step and its
graphs at one padded size) are `deterministic_slice`'s.

    python -m benchmarks run engine --only deterministic_tiny [--smoke]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..lib.context import Context

PROMPT_LENS = (64, 96, 128, 192, 256, 320, 384, 512)
NEW_TOKENS = 32


def _run(model: Path, deterministic: bool, lens: tuple[int, ...], new_tokens: int) -> dict[str, float]:
    from antumbra import Engine, SamplingParams
    from antumbra.config import SchedulerConfig

    engine = Engine.from_pretrained(model, scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
                                    deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
    times = []
    for _ in range(2):
        engine.clear_cache()
        started = time.perf_counter()
        engine.generate(prompts, params)
        times.append(time.perf_counter() - started)
    return {"seconds": times[-1], "tokens_per_s": len(prompts) * new_tokens / times[-1]}


DEVICE = "cpu"


def run(ctx: Context) -> dict[str, Any]:
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(2)
    lens, new_tokens = (PROMPT_LENS[:2], 4) if ctx.smoke else (PROMPT_LENS, NEW_TOKENS)
    result: dict[str, Any] = {"prompt_lens": lens, "new_tokens": new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny")
        result["default"] = _run(model, False, lens, new_tokens)
        result["deterministic"] = _run(model, True, lens, new_tokens)
    result["ratios"] = {"deterministic_vs_default_throughput": result["deterministic"]["tokens_per_s"]
                        / result["default"]["tokens_per_s"]}
    return result
