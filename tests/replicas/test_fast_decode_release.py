"""Release numerics on the fixed-shape decode step (FP8 KV rows and FP4 indexer keys read in their
codes, encoded writes, FP8 activation round trips) against the release PyTorch general step, on CPU
with the kernels interpreted, on a release-layout tiny checkpoint (packed weights are its own).

Both paths quantise the same values the same way; what differs is accumulation order (kernels
against torch), which can move a value across an FP8 / FP4 rounding boundary, so logprobs are
compared within a tolerance and the greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CSA, HCA, FastPathConfig, SchedulerConfig
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import TinyModelSpec, build_model, mtp_tensors
from antumbra.replicas.plan import DecodePath, NumericsMode

MAX_MODEL_LEN = 256
# A window of 8 and rates 4 and 8, so short prompts reach what the real rates reach only at hundreds
# of tokens: the long prompt's decodes close C4 windows at positions 43 and 47 and a C8 window at 47,
# past the SWA window, with more C4 entries (11) than the indexer keeps (8). Two rows, a graph size
# of 2: padded rows are test_fast_decode's (each interpreted step costs its graph size in rows).
SPEC = TinyModelSpec(seed=5, sliding_window=8, compress_rates={CSA: 4, HCA: 8})
PROMPTS = [list(range(3, 3 + n)) for n in (2, 43)]
NUM_TOKENS = 5
LOGPROB_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def release_checkpoint(tmp_path_factory):
    model = build_model(SPEC)
    return save_release_checkpoint(model.state_dict(), model.config, tmp_path_factory.mktemp("release"),
                                   mtp_state_dict=mtp_tensors(SPEC))


def _engine(path, decode: str, **fast) -> Engine:
    return Engine.from_pretrained(
        path, device="cpu", dtype="float32", numerics="release",
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 2), **fast),
    )


def _generate(engine: Engine):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    engine.check_integrity()
    return outs


# The packed formats a release-layout checkpoint keeps on CUDA. (Dense weights in release on the
# fixed-shape step, a combination "auto" never picks, were checked the same way when the step was
# built: tokens identical, logprobs within 9.5e-7; dropped from the suite for its time.)
@pytest.mark.parametrize("formats", [dict(expert_format="mxfp4", linear_format="fp8")], ids=["packed"])
def test_release_fast_decode_matches_the_release_general_path(release_checkpoint, formats):
    reference = _generate(_engine(release_checkpoint, "off", **formats))
    engine = _engine(release_checkpoint, "on", **formats)
    assert engine.plan.numerics is NumericsMode.RELEASE and engine.plan.decode is DecodePath.FIXED_SHAPE
    assert engine.pools.kv_format.dtype == torch.uint8  # the pools hold codes, read as codes
    fast = engine.runner.fast
    assert fast is not None
    fast.validate = True
    got = _generate(engine)
    assert fast.num_steps >= NUM_TOKENS - 1  # every decode after the prefill ran on the fast path
    worst = 0.0
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        for want, have in zip(ref.logprobs, out.logprobs, strict=True):
            (token, value), = want.items()
            worst = max(worst, abs(have[token] - value))
    print(f"release fast vs general: worst logprob difference {worst:.3e}")
    assert worst < LOGPROB_TOLERANCE, worst
