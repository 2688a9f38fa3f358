"""Context-parallel prefill over 2 and 4 ranks: the same logits (1e-4, fp32) and the same pool rows as
one rank, for prompts whose slice edges fall inside the window, a C4 window and a C128 window; the
bytes exchanged per layer are what the docstring's table says; the same ranks over a gloo group
(threads, each with its own pools) give the same logits and exchange the same rows."""

from __future__ import annotations

import pytest
import torch

from antumbra import Engine
from antumbra.config import CacheConfig
from antumbra.replicas.build import build_pools
from antumbra.replicas.context_parallel.handoff import run_gloo_ranks
from antumbra.replicas.context_parallel.prefill import cp_prefill, split_slices


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a loaded 2-core machine two OpenMP threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_pretrained(tiny_checkpoint, cache=CacheConfig(num_virtual_tokens=1024))


def fresh_pools(engine: Engine, num_tokens: int):
    pools = build_pools(engine.model_config, engine.config, engine.plan)
    vpages = pools.alloc_virtual_pages(-(-num_tokens // pools.layout.page_size))
    for v in vpages:
        pools.attach_swa(v)
    return pools, vpages


def assert_same_rows(single, ranks, vpages, slices):
    """Each rank's own positions and windows hold the rows one rank wrote there."""
    page = single.layout.page_size
    table = single.swa_page_table_host()
    for pools, (a, b) in zip(ranks, slices, strict=True):
        rows = torch.tensor([table[vpages[p // page]] * page + p % page for p in range(a, b)])
        assert torch.allclose(pools.swa_kv[:, rows], single.swa_kv[:, rows], atol=1e-5)
        for kind in ("compressors", "indexers"):
            for layer, pool in getattr(pools, kind).items():
                ref, m = getattr(single, kind)[layer], pool.spec.rate
                assert torch.allclose(pool.state_kv[rows], ref.state_kv[rows], atol=1e-5), (kind, layer)
                assert torch.allclose(pool.state_gate[rows], ref.state_gate[rows], atol=1e-5), (kind, layer)
                windows = range(a // m, b // m)  # closed by a token of this slice
                crows = torch.tensor(
                    [(vpages[w * m // page] * page + (w * m) % page) // m for w in windows], dtype=torch.long
                )
                assert torch.allclose(pool.rows[crows], ref.rows[crows], atol=1e-5), (kind, layer)


# Every edge inside a C4 window and a C128 window; 4 ranks: slices shorter than the window, so the
# window crossing an edge spans several earlier ranks.
@pytest.mark.parametrize("slices", [[(0, 150), (150, 300)], [(0, 53), (53, 110), (110, 171), (171, 230)]])
def test_cp_matches_one_rank(engine, slices):
    n, num_ranks = slices[-1][1], len(slices)
    ids = torch.randint(5, 261, (n,), generator=torch.Generator().manual_seed(n + num_ranks)).tolist()
    single, vpages = fresh_pools(engine, n)
    one = cp_prefill(engine.model, [single], vpages, ids, [(0, n)])
    ranks = [fresh_pools(engine, n)[0] for _ in range(num_ranks)]
    assert all(a % 4 and a % 128 for a, _ in slices[1:])
    cp = cp_prefill(engine.model, ranks, vpages, ids, slices)
    assert (cp.logits - one.logits).abs().max() < 1e-4
    assert_same_rows(single, ranks, vpages, slices)
    # the exchange table: SWA rows min(a_r, W - 1) per layer, every earlier compressed row
    lay = single.layout
    for ex in cp.exchanges:
        start = slices[ex.rank][0]
        assert ex.swa_rows == min(start, lay.window - 1)
        rates = [p.spec.rate for p in (single.compressors.get(ex.layer), single.indexers.get(ex.layer)) if p]
        assert ex.compressed_rows == sum(start // m for m in rates)
    assert cp.nbytes > 0 and not one.exchanges
    # the same over a gloo group: each rank its own thread and pools, the rows sent and received
    gloo = run_gloo(engine, ids, vpages, slices)
    assert (torch.cat([g.logits for g in gloo]) - one.logits).abs().max() < 1e-4
    order = lambda e: (e.rank, e.layer)  # noqa: E731
    assert sorted((e for g in gloo for e in g.exchanges), key=order) == sorted(cp.exchanges, key=order)


def run_gloo(engine, ids, vpages, slices):
    ranks = [fresh_pools(engine, slices[-1][1])[0] for _ in slices]
    return run_gloo_ranks(engine.model, ranks, vpages, ids, slices)


def test_split_slices():
    assert split_slices(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(ValueError):
        split_slices(3, 4)


def test_one_rank_is_the_model_forward(engine):
    n = 300
    ids = torch.randint(5, 261, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    pools, vpages = fresh_pools(engine, n)
    one = cp_prefill(engine.model, [pools], vpages, ids, [(0, n)])
    want = engine.prompt_logits(ids)
    assert (one.logits - want).abs().max() < 1e-4


def test_a_cp_prefill_hands_its_kv_to_a_decode_engine(engine, tiny_checkpoint):
    """The last rank's pools hold all a continuation reads: adopted, it decodes like one engine."""
    from antumbra import SamplingParams
    from antumbra.replicas.context_parallel.handoff import cp_prefill_payload

    n = 410
    ids = torch.randint(5, 261, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    want = engine.generate([ids], params)[0]
    payload = cp_prefill_payload(
        engine.model, lambda: fresh_pools(engine, 0)[0], ids, 4, "cp", over_gloo=True
    )
    decode = Engine.from_pretrained(tiny_checkpoint, cache=CacheConfig(num_virtual_tokens=1024))
    got = decode.disaggregation.adopt_generate(decode.disaggregation.reserve_adoption(ids, params, "cp"),
                                               payload)
    assert got.token_ids == want.token_ids
    chosen = lambda out: [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(chosen(got), chosen(want), strict=True)) < 1e-4
    decode.check_integrity()
