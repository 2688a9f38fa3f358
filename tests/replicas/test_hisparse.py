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
