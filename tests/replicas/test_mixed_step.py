"""Mixed steps: decode rows through the fixed-shape decode step beside prefill chunks on the
general forward, against the general step alone, on CPU with the fixed-shape step run eagerly.

The same comparison on the H200, with the decode graphs captured: the gpu-marked test below.
"""

from __future__ import annotations

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig
from antumbra.replicas.structured import json_schema_grammar
from tests.replicas.stepping import assert_same_outputs, run_by_hand

# Every prompt queued at once under a 64-token step budget: the short one decodes while the two
# long ones are prefilled in chunks beside it, then the middle one decodes beside the last's chunks.
PROMPTS = [list(range(3, 3 + n)) for n in (2, 126, 251)]
# The row decoding beside prefill chunks samples (seeded) under a JSON grammar's masks; the others
# are greedy, one with a presence penalty (sampled from its device-resident counts).
PAIR = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2, "maxItems": 2}
PARAMS = [
    SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=2, grammar=json_schema_grammar(PAIR)),
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True),
]


def _engine(path, decode: str, device: str = "cpu", hot_rows: int | None = None) -> Engine:
    return Engine.from_pretrained(
        path, device=device, dtype="float32",
        scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=64),
        cache=CacheConfig(hisparse_rows_per_request=hot_rows),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 2, 4)),
    )


@pytest.fixture(scope="module")
def general_cpu(tiny_checkpoint):
    """The general step's outputs on the CPU, which both CPU comparisons share."""
    return run_by_hand(_engine(tiny_checkpoint, "off"), PROMPTS, PARAMS)


def _compare(path, reference, device: str, tolerance: float, hot_rows: int | None = None) -> None:
    engine = _engine(path, "on", device, hot_rows)
    fast = engine.runner.fast
    assert fast is not None
    fast.validate = True  # every decode row's new KV row against the host's page tables
    got = run_by_hand(engine, PROMPTS, PARAMS)
    assert_same_outputs(reference, got, tolerance)
    assert got[0].finish_reason == "stop"  # its grammar ended it before max_tokens
    # Decode rows ran fixed-shape while prompts were still being prefilled beside them.
    assert engine.runner.num_mixed_steps >= 3
    assert fast.num_steps >= engine.runner.num_mixed_steps


def test_mixed_steps_match_the_general_step(tiny_checkpoint, general_cpu):
    _compare(tiny_checkpoint, general_cpu, "cpu", 1e-4)


def test_mixed_steps_with_hisparse_match_the_general_step(tiny_checkpoint, general_cpu):
    """The decode rows page their hot buffers in on the fixed-shape step while the chunks beside
    them write theirs on the general one (16 hot rows: the 251-token prompt's 62 C4 rows select)."""
    _compare(tiny_checkpoint, general_cpu, "cpu", 1e-4, hot_rows=16)


@pytest.mark.gpu
def test_mixed_steps_match_the_general_step_on_the_gpu(tiny_checkpoint):
    """The decode rows replay captured graphs; both steps' prefills run the Triton kernels."""
    reference = run_by_hand(_engine(tiny_checkpoint, "off", "cuda"), PROMPTS, PARAMS)
    _compare(tiny_checkpoint, reference, "cuda", 1e-3)
