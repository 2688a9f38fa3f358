"""Prompt rows: a step whose prompt chunks are short runs whole on the fixed-shape step, every prompt
token a row, against the general step alone, on CPU with the fixed-shape step run eagerly.

The same comparison on the H200, with the decode graphs captured: the gpu-marked test below, and the
engine suite's `mixed_step` benchmark (`--set prefill_rows=N`) times such steps.
"""

from __future__ import annotations

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import CSA, HCA, CacheConfig, FastPathConfig, SchedulerConfig
from antumbra.replicas.decode_rows import graph_batch_sizes
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint
from antumbra.replicas.structured import json_schema_grammar
from tests.replicas.stepping import assert_same_outputs, run_by_hand
from tests.replicas.test_mixed_step import PAIR

# A window of 8 and rates 4 and 8 (8-token pages): short prompts cross every boundary many times.
SPEC = TinyModelSpec(sliding_window=8, compress_rates={CSA: 4, HCA: 8})
# Queued at once under a 16-token step budget: every prompt is computed in chunks of at most 16
# tokens beside the others' decodes, from position 0 on, across the compression windows, the sliding
# window and the indexer's top-8 of the C4 entries; a repeat of the long prompt then starts past a
# cached prefix.
PROMPTS = [list(range(3, 3 + n)) for n in (2, 21, 50)]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=2, grammar=json_schema_grammar(PAIR)),
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True, presence_penalty=1.5),
    SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=1, ignore_eos=True),
]
# Rows the graph's race draws by itself (no ban, adjustment or cut): a rows step whose sampling rows
# are all such takes its tokens from the captured graph, not the sampler (the GPU test; the race at
# chosen rows against the sampler on the CPU: tests/replicas/test_graph_race.py).
PLAIN_PARAMS = [
    SamplingParams(max_tokens=6, temperature=1.0, seed=7, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=1, ignore_eos=True),
]
# Plain rows with nothing wanted but their tokens: their rows steps are launched overlapped, the next
# step scheduled before their tokens are read (`overlap.py`); one stops on a token's value.
LAUNCH_PARAMS = [
    SamplingParams(max_tokens=7, temperature=1.0, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.7, seed=3),
]
PREFILL_ROWS = 12


def _engine(path, decode: str, prefill_rows: int, device: str = "cpu", hot_rows: int | None = None,
            itl_budget_ms: float | None = None) -> Engine:
    return Engine.from_pretrained(
        path, device=device, dtype="float32",
        scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                                  itl_budget_ms=itl_budget_ms),
        cache=CacheConfig(hisparse_rows_per_request=hot_rows),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 2, 4, 8, 16),
                            prefill_rows=prefill_rows),
    )


def _run(engine: Engine, params: list[SamplingParams] = PARAMS) -> list:
    first = run_by_hand(engine, PROMPTS, params)
    again = run_by_hand(engine, [PROMPTS[2] + [9, 8, 7]], params[1])
    assert again[0].cached_tokens > 0
    return first + again


def _assert_same(reference, got, tolerance: float) -> None:
    assert_same_outputs(reference, got, tolerance)
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in reference]


def test_graph_sizes_reach_the_decodes_and_prompt_rows():
    engine_sizes = graph_batch_sizes
    from antumbra.config import EngineConfig

    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4),
                          fast=FastPathConfig(cuda_graph_batch_sizes=(1, 2, 4, 8, 16)))
    assert engine_sizes(config) == (1, 2, 4)
    assert engine_sizes(config, 12) == (1, 2, 4, 8, 16)
    assert engine_sizes(config, 20) == (1, 2, 4, 8, 16, 24)
    # Past the configured sizes each graph is half again the one before (8-row aligned): a rows
    # step pads to at most 1.5x its rows.
    assert engine_sizes(config, 100) == (1, 2, 4, 8, 16, 24, 40, 64, 96, 104)
    with pytest.raises(ValueError, match="prefill_rows"):
        FastPathConfig(prefill_rows=-1)


@pytest.fixture(scope="module")
def small_window(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rows") / "model", SPEC)


@pytest.fixture(scope="module")
def general_cpu(small_window):
    return _run(_engine(small_window, "off", 0))


def test_prompt_rows_match_the_general_step(small_window, general_cpu):
    """Under an inter-token budget no step can miss, so the prompt tokens beside decodes are bounded
    by the rows alone: 12 a step (the budget's bound while no general step is measured)."""
    engine = _engine(small_window, "on", PREFILL_ROWS, itl_budget_ms=1e6)
    budget = engine.core.scheduler.prefill_budget
    assert budget is not None and budget.limit(1) == PREFILL_ROWS
    fast = engine.runner.fast
    assert fast is not None and fast.max_batch_size == 4 + PREFILL_ROWS
    fast.validate = True  # every row's new KV row against the host's page tables
    got = _run(engine)
    _assert_same(general_cpu, got, 1e-4)
    assert got[0].finish_reason == "stop"  # its grammar ended it before max_tokens
    # Every step ran fixed-shape (a step with a prompt chunk as rows): none took the general step.
    assert engine.runner.num_prompt_row_steps >= 5
    # Eager (no graph): the sampler draws every row; the graphs' race draws them on the GPU (below).
    assert engine.runner.num_prompt_rows_drawn_in_graph == 0
    assert fast.num_steps == engine.core.num_steps and engine.runner.num_mixed_steps == 0
    assert budget.limit(1) == PREFILL_ROWS  # the measured rows keep it; the general line unmeasured


def test_overlapped_prompt_rows_match_the_general_step(small_window):
    """Rows steps whose tokens the race draws are launched before the previous step's tokens are
    read: the decodes' pending tokens taken on the device, the prompt chunks' rows from the host."""
    reference = _run(_engine(small_window, "off", 0), LAUNCH_PARAMS)
    engine = _engine(small_window, "on", PREFILL_ROWS, itl_budget_ms=1e6)
    fast = engine.runner.fast
    assert fast is not None
    fast.validate = True
    got = _run(engine, LAUNCH_PARAMS)
    _assert_same(reference, got, 0.0)
    overlap = engine.core.overlap
    assert overlap.num_rows_launches >= 3 and overlap.num_overlapped_steps > overlap.num_rows_launches
    assert engine.runner.num_prompt_row_steps >= 5 and engine.runner.num_mixed_steps == 0


def test_hisparse_keeps_prompt_chunks_on_the_general_step(small_window, general_cpu):
    """Each HiSparse request pages into one hot buffer, which two rows of it cannot share. (Rows
    beyond the step's 16-token budget are never used: no graph is built for them.)"""
    engine = _engine(small_window, "on", 10_000, hot_rows=16)
    assert engine.core.plan.prefill_rows == 16 and engine.runner.fast.max_batch_size == 4 + 16
    got = _run(engine)
    _assert_same(general_cpu, got, 1e-4)
    assert engine.runner.num_prompt_row_steps == 0 and engine.runner.num_mixed_steps > 0


@pytest.mark.gpu
def test_prompt_rows_match_the_general_step_on_the_gpu(small_window):
    """The rows replay captured graphs (the largest, 16 rows, holds the decodes and 12 prompt rows)."""
    reference = _run(_engine(small_window, "off", 0, "cuda"))
    engine = _engine(small_window, "on", PREFILL_ROWS, "cuda")
    got = _run(engine)
    _assert_same(reference, got, 1e-3)
    assert engine.runner.num_prompt_row_steps >= 5
    plain = _engine(small_window, "on", PREFILL_ROWS, "cuda")
    _assert_same(_run(_engine(small_window, "off", 0, "cuda"), PLAIN_PARAMS), _run(plain, PLAIN_PARAMS), 1e-3)
    assert plain.runner.num_prompt_rows_drawn_in_graph >= 5
    launched = _engine(small_window, "on", PREFILL_ROWS, "cuda", itl_budget_ms=1e6)
    launched.runner.fast.validate = True
    reference = _run(_engine(small_window, "off", 0, "cuda"), LAUNCH_PARAMS)
    _assert_same(reference, _run(launched, LAUNCH_PARAMS), 0.0)
    assert launched.core.overlap.num_rows_launches >= 3
