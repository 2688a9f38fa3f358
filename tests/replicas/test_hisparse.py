"""HiSparse: CSA rows on a host tier read through per-request hot buffers of 64 rows."""

from __future__ import annotations

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.cachestore.sizing import pool_device_bytes
from antumbra.config import CSA, HCA, CacheConfig, SchedulerConfig
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
HOT_ROWS = 64


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


def test_hot_buffer_of_64_rows_gives_identical_outputs(tiny_checkpoint):
    on = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", cache=CacheConfig(hisparse_rows_per_request=HOT_ROWS)
    )
    off = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    document = tokens(4100, seed=1)  # 1025 C4 rows per CSA layer
    prompts = [document + tokens(20, seed=2), document + tokens(33, seed=4)]
    for prompt in prompts:  # one at a time, so the second pages the first's cached rows in
        a = on.generate([prompt], GREEDY)[0]
        b = off.generate([prompt], GREEDY)[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x == pytest.approx(y, abs=1e-5)
        on.check_integrity()
    stats = on.stats()
    assert stats["host_tier_misses"] > 0 and stats["host_tier_hits"] > 0
    assert stats["cached_tokens"] > 0  # the second request reused the first's prefix from the host tier
    csa = on.pools.hot.layers[0]
    assert on.pools.compressors[csa].rows.device.type == "cpu"
    assert on.pools.hot.rows[csa].shape[0] == HOT_ROWS * on.config.scheduler.max_num_seqs


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    # Wide main heads and narrow indexer keys, as in the real model, so C4 rows dominate the pools.
    spec = TinyModelSpec(head_dim=64, index_head_dim=8, layer_types=(CSA, HCA), seed=3)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("wide") / "model", spec)


def max_concurrent_prefilled(engine: Engine, prompts: list[list[int]]) -> int:
    """Most requests holding a whole prompt's pages at once; they decode long enough to pile up."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.core.add_request(prompt, params)
    best = 0
    while engine.core.has_work():
        engine.core.step()
        running = engine.scheduler.running
        best = max(best, sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens))
    engine.check_integrity()
    return best


def test_host_tier_admits_three_times_more_long_requests_in_one_device_budget(wide_checkpoint):
    sched = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=2048)
    probe = Engine.from_pretrained(wide_checkpoint, device="cpu", dtype="float32", scheduler=sched)
    request_tokens = 2048 + 40
    page = probe.model_config.page_size
    pages_per_request = -(-request_tokens // page)
    dtype = torch.float32
    swa = probe.pools.layout.num_swa_pages
    # One budget for both: the fixed pools with hot buffers, plus two long requests' rows without a host tier.
    tier = CacheConfig(hisparse_rows_per_request=HOT_ROWS)
    fixed = pool_device_bytes(probe.model_config, tier, swa, sched.max_num_seqs, dtype, 0)
    per_page = pool_device_bytes(probe.model_config, CacheConfig(), swa, sched.max_num_seqs, dtype, 1)
    per_page -= pool_device_bytes(probe.model_config, CacheConfig(), swa, sched.max_num_seqs, dtype, 0)
    budget = fixed + 2 * pages_per_request * per_page
    without = Engine.from_pretrained(
        wide_checkpoint, device="cpu", dtype="float32", scheduler=sched,
        cache=CacheConfig(device_budget_bytes=budget),
    )
    with_tier = Engine.from_pretrained(
        wide_checkpoint, device="cpu", dtype="float32", scheduler=sched,
        cache=CacheConfig(device_budget_bytes=budget, hisparse_rows_per_request=HOT_ROWS),
    )
    assert without.pools.device_bytes() <= budget and with_tier.pools.device_bytes() <= budget
    prompts = [tokens(2048, seed=100 + i) for i in range(12)]
    plain_count = max_concurrent_prefilled(without, prompts)
    tier_count = max_concurrent_prefilled(with_tier, prompts)
    print(
        f"concurrent long requests in one device budget: {plain_count} without, "
        f"{tier_count} with the host tier"
    )
    assert plain_count >= 1
    assert tier_count >= 3 * plain_count, (plain_count, tier_count)


# ---------------------------------------------------------------- the fixed-shape decode step

FAST_LEN = 1024
# 251 tokens: 62 C4 rows, far more than the tiny model's top-8, so the page-ins select.
FAST_PROMPTS = [tokens(251, seed=5), tokens(126, seed=6), tokens(40, seed=7)]
FAST_TOKENS = 9


def _fast_engine(path, decode: str, hisparse: bool, device: str = "cpu",
                 overlap_indexer: bool = False, mixed_steps: bool = True) -> Engine:
    from antumbra.config import FastPathConfig

    return Engine.from_pretrained(
        path, device=device, dtype="float32",
        scheduler=SchedulerConfig(max_model_len=FAST_LEN, max_num_seqs=4),
        cache=CacheConfig(hisparse_rows_per_request=HOT_ROWS if hisparse else None),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 4), overlap_indexer=overlap_indexer,
                            mixed_steps=mixed_steps),
    )


def _staggered(engine: Engine, params: SamplingParams) -> dict[int, object]:
    """Each prompt joins once the one before it has 3 tokens: between joins all rows decode in
    fixed-shape steps; a joining prompt's prefill runs in a general step beside the others'
    decodes (without mixed steps: with them the decodes stay fixed-shape), which read their hot
    buffers by the host's maps. The third prompt's join finds maps
    the second's join filled and fixed-shape steps since made stale."""
    core = engine.core
    ids: dict[str, int] = {}
    final: dict[int, object] = {}
    for _ in range(200):
        if not core.has_work() and len(ids) == len(FAST_PROMPTS):
            break
        last = [rid for rid, i in ids.items() if i == len(ids) - 1]
        if len(ids) < len(FAST_PROMPTS) and (not last or len(core.requests[last[0]].output_token_ids) >= 3):
            ids[core.add_request(FAST_PROMPTS[len(ids)], params)] = len(ids)
        for out in core.step():
            if out.finished:
                final[ids[out.request_id]] = out
        if core.pools.hot is not None:
            core.pools.hot.check_integrity()
    engine.check_integrity()
    assert sorted(final) == [0, 1, 2]
    return final


def _assert_same_decodes(got: dict, references: tuple[dict, ...], logprob_tolerance: float) -> None:
    for i in range(len(FAST_PROMPTS)):
        for ref in references:
            assert got[i].token_ids == ref[i].token_ids
            for want, have in zip(ref[i].logprobs, got[i].logprobs, strict=True):
                (token, value), = want.items()
                assert have[token] == pytest.approx(value, abs=logprob_tolerance)


def test_hisparse_on_the_fixed_shape_step_matches_off_and_the_general_step(tiny_checkpoint):
    params = SamplingParams(max_tokens=FAST_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    off = _staggered(_fast_engine(tiny_checkpoint, "off", hisparse=False), params)
    general = _staggered(_fast_engine(tiny_checkpoint, "off", hisparse=True), params)
    # Without mixed steps, so the joins' general steps page in behind fixed-shape ones.
    engine = _fast_engine(tiny_checkpoint, "on", hisparse=True, mixed_steps=False)
    fast = engine.runner.fast
    assert fast is not None
    fast.validate = True  # every step's new rows against the host's page tables
    got = _staggered(engine, params)
    _assert_same_decodes(got, (off, general), 1e-4)
    # The lone decodes, then the joint ones, ran on the fixed-shape path and paged rows in there.
    assert fast.num_steps >= FAST_TOKENS
    hot = engine.pools.hot
    assert hot.rows_copied_on_device.item() > 0
    stats = engine.stats()
    assert stats["host_tier_rows_copied"] >= hot.rows_copied_on_device.item()
    assert stats["hot_buffer_device_bytes"] == hot.device_bytes()
    assert stats["host_tier_misses"] > 0  # the general steps' page-ins after fixed-shape ones


@pytest.mark.gpu
def test_hisparse_decode_graphs_on_a_gpu_match_the_general_step(tiny_checkpoint):
    """The page-ins inside captured graphs, reading pinned host rows through their device address."""
    def run(decode: str, hisparse: bool):
        engine = _fast_engine(tiny_checkpoint, decode, hisparse, device="cuda")
        params = SamplingParams(max_tokens=FAST_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
        return engine, _staggered(engine, params)

    _, off = run("off", hisparse=False)
    _, general = run("off", hisparse=True)
    engine, got = run("auto", hisparse=True)
    fast = engine.runner.fast
    assert fast is not None and fast.use_graphs and fast.num_steps >= FAST_TOKENS
    assert engine.pools.compressors[engine.pools.hot.layers[0]].rows.is_pinned()
    _assert_same_decodes(got, (off, general), 1e-3)
    assert engine.pools.hot.rows_copied_on_device.item() > 0


@pytest.mark.gpu
def test_hisparse_page_ins_wait_for_the_closed_window_with_the_indexer_on_a_second_stream(tiny_checkpoint):
    """The indexer on a side stream beside the main stream's compressor: the page-in, which reads the
    window the main stream closes this step, runs after the join, so the decodes equal the one-stream
    engine's bit for bit."""
    params = SamplingParams(max_tokens=FAST_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    one_stream = _staggered(_fast_engine(tiny_checkpoint, "on", hisparse=True, device="cuda"), params)
    engine = _fast_engine(tiny_checkpoint, "on", hisparse=True, device="cuda", overlap_indexer=True)
    assert engine.runner.fast is not None and engine.runner.fast.overlap_indexer
    _assert_same_decodes(_staggered(engine, params), (one_stream,), 0.0)


def test_hisparse_fixed_shape_steps_overlapped_and_padded(tiny_checkpoint):
    """Overlapped scheduling (no logprobs) launches the same page-ins; a step of padded rows only
    copies nothing and leaves every hot buffer as it was."""
    from antumbra.replicas.model.fast_decode import decode_step

    params = SamplingParams(max_tokens=FAST_TOKENS, temperature=0.0, ignore_eos=True)
    general = _staggered(_fast_engine(tiny_checkpoint, "off", hisparse=True), params)
    engine = _fast_engine(tiny_checkpoint, "on", hisparse=True)
    got = _staggered(engine, params)
    assert engine.core.overlap.num_overlapped_steps >= 3
    for i in range(len(FAST_PROMPTS)):
        assert got[i].token_ids == general[i].token_ids
    fast, hot = engine.runner.fast, engine.pools.hot
    before = {layer: rows.clone() for layer, rows in hot.rows.items()}
    copied = hot.rows_copied_on_device.item()
    fast.inputs.active.fill_(0)
    fast.inputs.positions.fill_(255)
    fast.inputs.input_ids.fill_(0)  # the last overlapped launch left a pending (-1) id
    decode_step(engine.model, fast.inputs.head(4), engine.pools, fast._shapes[4])
    assert hot.rows_copied_on_device.item() == copied
    for layer, rows in hot.rows.items():
        assert torch.equal(rows, before[layer])
    hot.check_integrity()


# ---------------------------------------------------------------- prefill on the general step

# Window 16 and rates 4 / 16 keep the work small; the hot buffer holds one top-8 selection, so every
# prefill chunk picks far more rows than it.
PREFILL_HOT_ROWS = 8
# PyTorch path: 150 tokens (37 C4 rows) in chunks of 48 (long: staged on the device) and a tail of 6
# (a short chunk of several tokens); the second prompt prefills beside the first one's decodes.
# Interpreted kernels: one chunk of 32 (the shortest long chunk) and a tail of 8, 10 C4 rows.
PREFILL_CASES = {"off": ([tokens(150, seed=11), tokens(90, seed=12)], 48, 6),
                 "on": ([tokens(40, seed=11)], 32, 2)}


@pytest.fixture(scope="module")
def short_window_checkpoint(tmp_path_factory):
    spec = TinyModelSpec(sliding_window=16, compress_rates={CSA: 4, HCA: 16})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("short") / "model", spec)


def _prefill_engine(path, kernels: str, hisparse: bool, chunk: int, device: str = "cpu") -> Engine:
    from antumbra.config import FastPathConfig

    return Engine.from_pretrained(
        path, device=device, dtype="float32",
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=chunk, max_num_seqs=2),
        cache=CacheConfig(hisparse_rows_per_request=PREFILL_HOT_ROWS if hisparse else None,
                          num_virtual_tokens=4096),
        fast=FastPathConfig(decode="off", general_kernels=kernels),
    )


def _prefill_on_then_decode_beside(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """The first prompt's prefill alone (with HiSparse it must page nothing into the hot buffers), then
    the rest join while it decodes; -> the final outputs in prompt order."""
    hot, core = engine.pools.hot, engine.core

    def counted() -> tuple[int, int, int]:
        return (hot.counters.hits, hot.counters.misses, hot.counters.rows_copied) if hot else (0, 0, 0)

    def check() -> None:
        if hot is not None:
            hot.check_integrity()

    before = counted()  # an engine's warm-up (on by default on a GPU) pages rows in too
    ids = [core.add_request(prompts[0], params)]
    while not core.requests[ids[0]].output_token_ids:
        core.step()
        check()
    assert counted() == before
    ids += [core.add_request(p, params) for p in prompts[1:]]
    final = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        check()
    engine.check_integrity()
    if hot is not None:
        assert hot.counters.misses > before[1]  # the decodes paged rows in
    return [final[i] for i in ids]


def _assert_same_outputs(got: list, want: list, tolerance: float) -> None:
    """Tokens equal, each chosen token's logprob within `tolerance`."""
    for have, ref in zip(got, want, strict=True):
        assert have.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, have.logprobs, strict=True):
            (token, value), = a.items()
            assert b[token] == pytest.approx(value, abs=tolerance)


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_hisparse_prefill_matches_off_and_writes_the_host_tier(short_window_checkpoint, kernels):
    """HiSparse prefill (long chunks staged on the device, their rows written through to the host
    tier) gives the greedy tokens and logprobs of the engine without HiSparse (on the PyTorch path:
    the interpreted kernels are compared with it, as in test_general_kernels); the host tier ends
    holding the rows the device pool holds without HiSparse."""
    prompts, chunk, new_tokens = PREFILL_CASES[kernels]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    on = _prefill_engine(short_window_checkpoint, kernels, True, chunk)
    got = _prefill_on_then_decode_beside(on, prompts, params)
    off = _prefill_engine(short_window_checkpoint, "off", False, chunk)
    want = _prefill_on_then_decode_beside(off, prompts, params)
    tolerance = 1e-5 if kernels == "off" else 1e-4
    _assert_same_outputs(got, want, tolerance)
    for layer in on.pools.hot.layers:
        tier, device_pool = on.pools.compressors[layer].rows, off.pools.compressors[layer].rows
        assert tier.device.type == "cpu" and bool(tier.abs().sum() > 0)
        torch.testing.assert_close(tier, device_pool, rtol=0, atol=tolerance)


@pytest.mark.gpu
def test_hisparse_prefill_on_a_gpu_matches_off(tiny_checkpoint):
    """On the device: long chunks staged from the pinned host tier through its device mapping, their
    rows written through on the side stream; 600 tokens in chunks of 128 (150 C4 rows, a buffer of 8)."""
    prompts = [tokens(600, seed=21), tokens(300, seed=22)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    on = _prefill_engine(tiny_checkpoint, "on", True, 128, device="cuda")
    got = _prefill_on_then_decode_beside(on, prompts, params)
    off = _prefill_engine(tiny_checkpoint, "on", False, 128, device="cuda")
    want = _prefill_on_then_decode_beside(off, prompts, params)
    assert on.pools.compressors[on.pools.hot.layers[0]].rows.is_pinned()
    _assert_same_outputs(got, want, 1e-4)
    for layer in on.pools.hot.layers:
        torch.testing.assert_close(on.pools.compressors[layer].rows, off.pools.compressors[layer].rows.cpu(),
                                   rtol=0, atol=1e-4)
