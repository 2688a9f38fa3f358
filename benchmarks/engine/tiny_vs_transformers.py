"""Batched engine throughput against transformers on the tiny model, fp32 on this CPU.

8 prompts of mixed lengths (100-1500 tokens), 64 greedy tokens each. transformers
runs one prompt at a time (its padding is wrong for this model: compressor windows
ignore the attention mask). Both produce the same tokens; the script checks that.

    python -m benchmarks run engine --only tiny_vs_transformers [--smoke]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from antumbra import Engine, SamplingParams
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

from ..lib.context import Context

PROMPT_LENGTHS = (100, 250, 400, 600, 800, 1000, 1250, 1500)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def run_engine(path: Path, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([batch[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def run_transformers(path: Path, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generate(torch.tensor([batch[0][:16]]), max_new_tokens=2, do_sample=False)  # warm-up
    tokens = []
    start = time.perf_counter()
    with torch.no_grad():
        for ids in batch:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            tokens.append(out[0, len(ids) :].tolist())
    return time.perf_counter() - start, tokens


DEVICE = "cpu"


def run(ctx: Context) -> dict[str, Any]:
    """Options: new_tokens, threads (torch intra-op threads, the same for both)."""
    new_tokens = ctx.option("new_tokens", 4 if ctx.smoke else 64)
    torch.set_num_threads(ctx.option("threads", 1))
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        batch = prompts(TinyModelSpec().vocab_size)[: 2 if ctx.smoke else None]
        ours_s, ours_tokens = run_engine(path, batch, new_tokens)
        theirs_s, theirs_tokens = run_transformers(path, batch, new_tokens)
    total = len(batch) * new_tokens
    same = ours_tokens == theirs_tokens
    return {
        "workload": {"prompt_lengths": [len(p) for p in batch], "new_tokens": new_tokens, "dtype": "float32"},
        "engine_s": ours_s,
        "transformers_s": theirs_s,
        "engine_tokens_per_s": total / ours_s,
        "transformers_tokens_per_s": total / theirs_s,
        # Only from a run whose tokens agree: a faster wrong answer is no figure.
        "ratios": {"engine_vs_transformers_tokens_per_s": theirs_s / ours_s} if same else {},
        "same_tokens": same,
    }
