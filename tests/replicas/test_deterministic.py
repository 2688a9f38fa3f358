"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same alone, in batches of
2 and 8 with other prompts, under any prefill chunking and after a cache hit; on the general step
and on the fixed-shape decode step (its one padded size).

The default mode is checked to differ somewhere over the same runs (its batched matmuls and
attention widths follow the batch), so the test can tell the modes apart.
"""

from __future__ import annotations

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig

TARGET = [(3 * i) % 250 + 5 for i in range(300)]  # two full pages to cache, C4 and C128 windows
OTHERS = [[(7 * i + j) % 250 + 5 for j in range(11 + 13 * i)] for i in range(7)]
PARAMS = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=77, logprobs=3, ignore_eos=True)


def _engine(tiny_checkpoint, deterministic: bool, chunk: int | None = None) -> Engine:
    sched = SchedulerConfig(max_num_seqs=8, max_model_len=512, max_prefill_chunk_tokens=chunk)
    return Engine.from_pretrained(tiny_checkpoint, scheduler=sched, deterministic=deterministic)


def _runs(tiny_checkpoint, deterministic: bool) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(tokens, logprobs) of TARGET: alone, with 1 and with 7 other prompts, chunked 1 / 7 / 64,
    and a second time on the same engine (its prefix then cached)."""
    runs = []
    engine = _engine(tiny_checkpoint, deterministic)
    for batch in ([TARGET], [OTHERS[0], TARGET], [*OTHERS[:3], TARGET, *OTHERS[3:]]):
        params = [PARAMS if p is TARGET else SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
                  for p in batch]
        out = engine.generate(batch, params)[batch.index(TARGET)]
        runs.append((out.token_ids, out.logprobs))
    hit = engine.generate([TARGET], PARAMS)[0]
    assert hit.cached_tokens > 0  # the prefix came from the cache this time
    runs.append((hit.token_ids, hit.logprobs))
    for chunk in (1, 7, 64):
        out = _engine(tiny_checkpoint, deterministic, chunk).generate([TARGET, OTHERS[1]], PARAMS)[0]
        runs.append((out.token_ids, out.logprobs))
    return runs


def test_deterministic_mode_is_bitwise_batch_invariant(tiny_checkpoint):
    runs = _runs(tiny_checkpoint, deterministic=True)
    tokens, logprobs = runs[0]
    assert len(tokens) == 32
    for other_tokens, other_logprobs in runs[1:]:
        assert other_tokens == tokens
        assert other_logprobs == logprobs  # float equality: bitwise


def test_default_mode_is_not(tiny_checkpoint):
    runs = _runs(tiny_checkpoint, deterministic=False)
    assert any(lp != runs[0][1] for _, lp in runs[1:]), (
        "the default mode gave bitwise-equal logprobs everywhere"
    )


def test_fixed_shape_step_is_bitwise_batch_invariant(tiny_checkpoint):
    """Batch-invariant mode on the fixed-shape step (its kernels interpreted), which computes prompt
    tokens and decodes alike, at one padded size (2): a prompt alone and among three others gives
    the same tokens and bitwise-equal logprobs. Among the others, one is a token shorter (its decode
    shares a replay with the target's prompt tokens), one returns its routed experts (so its tokens
    take one-token forwards of their own beside the replays, and its sample row sits between
    theirs), and three rows at once take two replays."""
    from antumbra.config import FastPathConfig

    engine = Engine.from_pretrained(
        tiny_checkpoint, deterministic=True, fast=FastPathConfig(decode="on", cuda_graph_batch_sizes=(1, 2)),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256),
    )
    graphs = engine.core.runner.fast
    assert graphs is not None and graphs.batch_sizes == (2,)  # one padded size for every step
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=5, logprobs=2, ignore_eos=True)
    alone = engine.generate([[17, 4]], params)[0]
    assert graphs.num_steps == 3  # two prompt tokens and a decode, a replay each
    routed = SamplingParams(max_tokens=2, temperature=0.0, return_routed_experts=True, ignore_eos=True)
    together = engine.generate([[8], [17, 4], [5, 6], [9, 10]], [params, params, routed, params])
    assert graphs.num_steps == 3 + 5
    assert len(alone.token_ids) == 2 and together[2].routed_experts is not None
    assert together[1].token_ids == alone.token_ids
    assert together[1].logprobs == alone.logprobs  # float equality: bitwise
