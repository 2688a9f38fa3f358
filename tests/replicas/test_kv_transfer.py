"""KV export / adopt between two engines: a prefill engine computes the prompt and t0, a decode engine
adopts its rows (skipping prefix pages it caches) and decodes on: the same greedy tokens as one engine,
in exact and release numerics, with both cores intact after every step, and nothing held or leaked
when a transfer fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig
from antumbra.replicas.errors import RequestFailedError
from antumbra.replicas.kv_transfer.adopt import AdoptionError, adopt, cancel, reserve
from antumbra.replicas.kv_transfer.disaggregation import prefill_params
from antumbra.replicas.kv_transfer.payload import row_arithmetic

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
CACHE = CacheConfig(num_virtual_tokens=4096)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a loaded 2-core machine two OpenMP threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["exact", "release"])
def trio(request, tiny_checkpoint):
    """(one engine, prefill engine, decode engine) in one numerics mode, stepped by hand (no driver)."""
    make = lambda: Engine.from_pretrained(tiny_checkpoint, cache=CACHE, numerics=request.param)  # noqa: E731
    return make(), make(), make()


def run_pd(prefill: Engine, decode: Engine, prompt: list[int], params=GREEDY, rid="r"):
    """Drive both cores by hand, checking both after every step; -> (final output, payload)."""
    pc, dc = prefill.core, decode.core
    held = dc.make_request(prompt, params, rid)
    skip = reserve(dc, held)
    dc.check_integrity()
    pc.add(pc.make_request(prompt, prefill_params(params), rid, export_kv_from=skip,
                           export_draft_streams=dc.speculates(held)))
    payload = None
    while payload is None:
        for out in pc.step():
            payload = out.kv_export if out.finished else None
        pc.check_integrity()
    final = adopt(dc, held, payload) or []
    dc.check_integrity()
    while not final:
        final = [o for o in dc.step() if o.finished]
        dc.check_integrity()
    return final[0], payload


def one_engine(engine: Engine, prompt: list[int], params=GREEDY):
    core = engine.core
    rid = core.add_request(prompt, params)
    return core.run_until_finished([rid])[0]


@pytest.mark.parametrize("n", [5, 128, 300])
def test_pd_matches_one_engine(trio, n):
    single, prefill, decode = trio
    prompt = tokens(n, seed=n)
    want = one_engine(single, prompt)
    got, payload = run_pd(prefill, decode, prompt, rid=f"pd-{n}")
    assert got.token_ids == want.token_ids
    chosen = lambda out: [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]  # noqa: E731
    assert max(abs(x - y) for x, y in zip(chosen(got), chosen(want), strict=True)) < 1e-4
    assert payload.skip_pages == 0
    assert payload.nbytes == row_arithmetic(decode.pools, n, 0)["total"]


def test_decode_skips_the_prefix_pages_it_caches(trio):
    single, prefill, decode = trio
    system = tokens(300, seed=7)
    first, _ = run_pd(prefill, decode, system + tokens(20, seed=8), rid="first")  # decode now caches 2 pages
    before = dict(vars(decode.core.transfers))
    prompt = system + tokens(100, seed=9)
    got, payload = run_pd(prefill, decode, prompt, rid="second")
    assert got.token_ids == one_engine(single, prompt).token_ids
    assert payload.skip_pages == 2
    assert payload.nbytes == row_arithmetic(decode.pools, len(prompt), 2)["total"]
    assert payload.nbytes < row_arithmetic(decode.pools, len(prompt), 0)["total"]
    t = decode.core.transfers
    assert t.skipped_pages - before["skipped_pages"] == 2
    assert t.adopted_pages - before["adopted_pages"] == 2  # pages 2 and 3 of the 400-token prompt
    assert decode.stats()["kv_skipped_pages"] == t.skipped_pages


def free_pages(engine: Engine) -> tuple[int, int]:
    return engine.pools.num_free_virtual_pages, engine.pools.num_free_swa_pages


def test_a_failed_transfer_leaves_both_intact(trio, tiny_checkpoint):
    single, prefill, decode = trio
    prompt = tokens(260, seed=11)
    run_pd(prefill, decode, prompt, rid="warm")  # decode caches 2 pages of this prompt
    dc = decode.core
    free_before, locks_before = free_pages(decode), [n.full_lock for n in dc.kv.tree.nodes_by_depth()]
    held = dc.make_request(prompt + [9, 9], GREEDY, "bad")
    skip = reserve(dc, held)
    payload = prefill.disaggregation.prefill_export(prompt + [9, 9], GREEDY, skip, request_id="bad")
    prefill.check_integrity()
    broken = [
        dataclasses.replace(payload, prompt_token_ids=payload.prompt_token_ids[:-1] + (10,)),
        dataclasses.replace(payload, skip_pages=skip + 1),
        dataclasses.replace(payload, tensors={**payload.tensors, "swa": payload.tensors["swa"][:, 1:]}),
        dataclasses.replace(payload, tensors={k: v for k, v in payload.tensors.items() if k != "swa"}),
        dataclasses.replace(payload, first_token=10**6),
    ]
    other = Engine.from_pretrained(
        tiny_checkpoint, cache=CACHE, numerics="release" if dc.plan.numerics.value == "exact" else "exact"
    )
    other_held = other.core.make_request(prompt + [9, 9], GREEDY, "bad")
    reserve(other.core, other_held)
    with pytest.raises(AdoptionError, match="layout"):
        adopt(other.core, other_held, payload)
    for bad in broken:
        with pytest.raises(AdoptionError):
            adopt(dc, held, bad)
        dc.check_integrity()
        assert free_pages(decode) == free_before
    cancel(dc, held)
    dc.check_integrity()
    assert free_pages(decode) == free_before
    assert [n.full_lock for n in dc.kv.tree.nodes_by_depth()] == locks_before
    # through the driver: a refused adoption fails the request and drops its reservation
    res = decode.disaggregation.reserve_adoption(prompt + [9, 9], GREEDY, "bad-2")
    with pytest.raises(RequestFailedError, match="another prompt"):
        decode.disaggregation.adopt_generate(res, broken[0])
    decode.check_integrity()
    assert free_pages(decode) == free_before
    res = decode.disaggregation.reserve_adoption(prompt + [9, 9], GREEDY, "good")
    adopted = decode.disaggregation.adopt_generate(res, payload)
    assert adopted.token_ids == one_engine(single, prompt + [9, 9]).token_ids
    decode.check_integrity()
