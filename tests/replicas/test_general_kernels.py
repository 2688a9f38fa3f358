"""The general step (prefill chunks, mixed batches) through the Triton kernels against the PyTorch
path, on CPU with the kernels interpreted. The same wiring runs on the H200 in
`tests/replicas/test_gpu_paths.py` (greedy agreement with the CPU engine)."""

from __future__ import annotations

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import FastPathConfig, SchedulerConfig
from antumbra.replicas.plan import PlanError

# On a checkpoint with a 16-token window and rates 4 / 16, with 13-token chunks: chunks longer
# than the window's remainder, C4 windows closing inside chunks and across their boundaries, C16
# windows at positions 15 and 31 and the sliding window crossing chunk edges, at a fraction of the
# interpreted work the default checkpoint's window of 128 would need.
PROMPTS = [list(range(5, 5 + n)) for n in (3, 14, 37)]
CHUNK_TOKENS = 13


@pytest.fixture(scope="module")
def short_window_checkpoint(tmp_path_factory):
    from antumbra.config import CSA, HCA
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    spec = TinyModelSpec(sliding_window=16, compress_rates={CSA: 4, HCA: 16})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("short") / "model", spec)


def _run(path, kernels: str, chunk: int):
    engine = Engine.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=chunk, max_num_seqs=4),
        fast=FastPathConfig(decode="off", general_kernels=kernels),
    )
    outs = engine.generate(
        PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, ignore_eos=True)
    )
    engine.check_integrity()
    return outs


def test_general_step_through_kernels_matches_pytorch(short_window_checkpoint):
    reference = _run(short_window_checkpoint, "off", CHUNK_TOKENS)
    got = _run(short_window_checkpoint, "on", CHUNK_TOKENS)
    for want, have in zip(reference, got, strict=True):
        assert have.token_ids == want.token_ids
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            (token, value), = a.items()
            assert b[token] == pytest.approx(value, abs=1e-4)


def test_release_numerics_refuse_the_kernels(tiny_checkpoint):
    with pytest.raises(PlanError, match="general_kernels='on' conflicts with numerics='release'"):
        Engine.from_pretrained(tiny_checkpoint, numerics="release", fast=FastPathConfig(general_kernels="on"))
    engine = Engine.from_pretrained(tiny_checkpoint, numerics="release")
    assert not engine.model.use_kernels
    with pytest.raises(ValueError, match="exact numerics"):
        engine.model.set_kernels(True)


def test_a_short_prompt_alone_before_any_window_closes(tiny_checkpoint):
    # Three tokens close no compression window: the indexer has no candidate to choose from.
    def run(kernels: str) -> list[int]:
        engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SchedulerConfig(max_model_len=1024),
                                        fast=FastPathConfig(decode="off", general_kernels=kernels))
        return engine.generate([[7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[
            0
        ].token_ids

    assert run("on") == run("off")
