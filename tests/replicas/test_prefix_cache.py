"""Prefix caching in the engine: same results with the cache as without and as transformers,
honest `cached_tokens`, bounded SWA, replay under SWA pressure, namespaces, preemption."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, SchedulerConfig
from tests.replicas.stepping import run_by_hand

ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


@dataclass
class Turn:
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int
    computed_prompt_tokens: int


def serve_one(engine: Engine, prompt: list[int], params=GREEDY, namespace="default") -> Turn:
    before = engine.stats()["computed_prompt_tokens"]
    out = engine.generate([prompt], params, namespace=namespace)[0]
    computed = int(engine.stats()["computed_prompt_tokens"] - before)
    engine.check_integrity()
    chosen = [lp[t] for lp, t in zip(out.logprobs or [], out.token_ids, strict=False)]
    return Turn(prompt, out.token_ids, chosen, out.cached_tokens, computed)


def shared_prefix_workload(engine: Engine) -> list[Turn]:
    """Two system prompts (300 and 1000 tokens), two users each, then a second turn per user."""
    turns = []
    for s, system_len in enumerate((300, 1000)):
        system = tokens(system_len, seed=100 + s)
        for user in range(2):
            first = serve_one(engine, system + tokens(50, seed=200 + 10 * s + user))
            turns.append(first)
            follow = first.prompt + first.token_ids + tokens(30, seed=300 + 10 * s + user)
            turns.append(serve_one(engine, follow))
    return turns


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    cached = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    plain = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", cache=CacheConfig(enable_prefix_caching=False)
    )
    return cached, plain


def test_shared_prefix_workload_matches_no_cache_and_transformers(engines, tiny_checkpoint):
    cached, plain = engines
    cached.clear_cache()  # the engines are shared by the module's tests: start from an empty cache
    before = cached.stats()
    with_cache = shared_prefix_workload(cached)
    without = shared_prefix_workload(plain)
    page = cached.model_config.page_size
    for a, b in zip(with_cache, without, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < ATOL
        # cached_tokens is exactly the page-aligned prefix the engine did not compute
        assert a.cached_tokens % page == 0
        assert a.cached_tokens + a.computed_prompt_tokens == len(a.prompt)
        assert b.cached_tokens == 0
    # second users hit the short system prompt directly, and the long one through replay
    assert with_cache[2].cached_tokens == 2 * page
    assert with_cache[6].cached_tokens > 0
    # second turns reuse the whole first turn
    for first, follow in ((with_cache[0], with_cache[1]), (with_cache[4], with_cache[5])):
        assert follow.cached_tokens == (len(first.prompt) + len(first.token_ids) - 1) // page * page
    after = cached.stats()  # counters are cumulative: this workload's share is the difference
    assert after["replays"] - before["replays"] >= 1
    cached_tokens = after["cached_tokens"] - before["cached_tokens"]
    assert cached_tokens / (after["prompt_tokens"] - before["prompt_tokens"]) > 0.3

    reference = DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    for turn in with_cache:
        gen = reference.generate(
            torch.tensor([turn.prompt]), max_new_tokens=16, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )
        assert gen.sequences[0, len(turn.prompt) :].tolist() == turn.token_ids
        ref = [
            torch.log_softmax(step[0].float(), -1)[t].item()
            for step, t in zip(gen.logits, turn.token_ids, strict=True)
        ]
        assert max(abs(x - y) for x, y in zip(ref, turn.logprobs, strict=True)) < ATOL


def test_long_prefill_keeps_one_window_of_swa_and_every_compressed_row(engines):
    engine, _ = engines
    engine.clear_cache()
    prompt = tokens(10_000, seed=7)
    rid = engine.core.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    request = engine.core.requests[rid]
    while request.num_computed_tokens < len(prompt):
        engine.core.step()
        engine.check_integrity()
    layout = engine.pools.layout
    page, window = layout.page_size, layout.window
    held_rows = engine.pools.num_swa_pages_of(request.kv.vpages) * page
    assert held_rows <= window + page
    for pools in (engine.pools.compressors, engine.pools.indexers):
        for pool in pools.values():
            rate = pool.spec.rate
            rows = [
                (request.kv.vpages[(w * rate) // page] * page + (w * rate) % page) // rate
                for w in range(len(prompt) // rate)
            ]
            written = pool.rows[rows].abs().sum(dim=-1) > 0
            assert bool(written.all()), f"layer {pool.spec.layer}: compressed rows missing"
    engine.core.run_until_finished([rid])
    engine.check_integrity()


# "release" stores FP8 / FP4 codes in the pools: replays and preemptions rewrite rows through them.
@pytest.mark.parametrize("numerics", ["exact", "release"])
def test_squeezed_swa_pool_serves_a_repeated_prefix_by_replay(tiny_checkpoint, numerics):
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128)
    squeezed = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", scheduler=sched, cache=CacheConfig(num_swa_pages=6),
        numerics=numerics,
    )
    plain = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", cache=CacheConfig(enable_prefix_caching=False),
        numerics=numerics,
    )
    document = tokens(1100, seed=11)
    serve_one(squeezed, document + tokens(20, seed=12))
    question = document + tokens(25, seed=13)
    tree, page = squeezed.kv.tree, squeezed.model_config.page_size
    for filler in range(12):
        match = tree.match("default", question, (len(question) - 1) // page, touch=False)
        if match.num_swa_pages < match.num_full_pages:
            break
        serve_one(squeezed, tokens(300, seed=500 + filler), SamplingParams(max_tokens=2, temperature=0.0))
    assert match.num_swa_pages < match.num_full_pages, "the SWA tail was never evicted"
    before = squeezed.stats()
    again = serve_one(squeezed, question)
    after = squeezed.stats()
    assert after["replays"] == before["replays"] + 1
    replayed = after["replayed_tokens"] - before["replayed_tokens"]
    layers, window = squeezed.model_config.num_layers, squeezed.model_config.sliding_window
    assert 0 < replayed <= -(-layers * window // page) * page
    assert again.cached_tokens > 0
    assert again.cached_tokens + again.computed_prompt_tokens == len(question)
    reference = serve_one(plain, question)
    assert again.token_ids == reference.token_ids
    assert max(abs(x - y) for x, y in zip(again.logprobs, reference.logprobs, strict=True)) < ATOL


def test_namespaces_share_nothing_unless_shared(engines):
    engine, _ = engines
    engine.clear_cache()
    prompt = tokens(400, seed=21)
    first = serve_one(engine, prompt, namespace="tenant-a")
    assert serve_one(engine, prompt, namespace="tenant-a").cached_tokens > 0
    assert serve_one(engine, prompt, namespace="tenant-b").cached_tokens == 0
    assert first.cached_tokens == 0
    serve_one(engine, prompt, namespace="shared")
    assert serve_one(engine, prompt, namespace="shared").cached_tokens > 0


RELEASE_SHARED_TOKENS = 16


@pytest.mark.parametrize("numerics", ["exact", "release"])
def test_pool_exhaustion_preempts_and_everything_finishes_the_same(tiny_checkpoint, numerics):
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompts = [tokens(260 + 30 * i, seed=40 + i) for i in range(6)]
    scheduler = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=512)

    def run(engine: Engine) -> list:
        # Stepped by hand with every request queued first (release numerics are not batch-invariant:
        # a batch formed while requests are still arriving would change the reference).
        return run_by_hand(engine, prompts, params)

    roomy = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32", numerics=numerics,
                                   scheduler=scheduler)
    expected = run(roomy)
    tight = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", scheduler=scheduler,
        cache=CacheConfig(num_virtual_tokens=12 * 128),
        numerics=numerics,
    )
    assert (tight.pools.swa_kv.dtype == torch.uint8) == (numerics == "release")
    got = run(tight)
    assert roomy.stats()["preemptions"] == 0
    assert tight.stats()["preemptions"] > 0
    for out, want in zip(got, expected, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
        if numerics == "exact":
            assert out.token_ids == want.token_ids
        else:
            # Release numerics round every KV row through FP8 from activations computed in the step
            # that wrote it: a preempted request's rows, recomputed in a prefill chunk, are not the
            # bits its decode steps wrote, so its greedy tokens may part from the reference after a
            # near-tie; the tokens drawn before any preemption pressure are the same.
            assert out.token_ids[:RELEASE_SHARED_TOKENS] == want.token_ids[:RELEASE_SHARED_TOKENS]


LONG_ANSWER = SamplingParams(max_tokens=300, temperature=0.0, logprobs=0, ignore_eos=True)


def reuse_boundary(engine: Engine, prompt: list[int]) -> int:
    page = engine.model_config.page_size
    return (len(prompt) - 1) // page * page


def test_a_prompt_repeated_after_a_long_answer_hits_its_whole_boundary(engines):
    cached, plain = engines
    cached.clear_cache()
    prompt = tokens(300, seed=61)
    first = serve_one(cached, prompt, LONG_ANSWER)
    again = serve_one(cached, prompt, LONG_ANSWER)
    reference = serve_one(plain, prompt, LONG_ANSWER)
    assert first.cached_tokens == 0
    assert again.cached_tokens == reuse_boundary(cached, prompt) > 0
    assert again.cached_tokens + again.computed_prompt_tokens == len(prompt)
    for turn in (first, again):
        assert turn.token_ids == reference.token_ids
        assert max(abs(x - y) for x, y in zip(turn.logprobs, reference.logprobs, strict=True)) < ATOL


@pytest.mark.parametrize("length", [256, 384, 512])
def test_a_page_aligned_prompt_repeated_hits(engines, length):
    cached, plain = engines
    cached.clear_cache()
    prompt = tokens(length, seed=70 + length)
    assert serve_one(cached, prompt).cached_tokens == 0
    again = serve_one(cached, prompt)
    assert again.cached_tokens == reuse_boundary(cached, prompt) == length - cached.model_config.page_size
    assert again.token_ids == serve_one(plain, prompt).token_ids


def test_requests_sharing_a_system_prompt_one_after_another_hit_it(engines):
    cached, plain = engines
    cached.clear_cache()
    page = cached.model_config.page_size
    system = tokens(300, seed=81)
    # answers long enough to slide past the system prompt's last page (a window of 128 tokens)
    params = SamplingParams(max_tokens=160, temperature=0.0, logprobs=0, ignore_eos=True)
    prompts = [system + tokens(20 + 10 * i, seed=90 + i) for i in range(3)]
    turns = [serve_one(cached, p, params) for p in prompts]
    assert turns[0].cached_tokens == 0
    for turn in turns[1:]:
        assert turn.cached_tokens == len(system) // page * page
    for turn, prompt in zip(turns, prompts, strict=True):
        assert turn.token_ids == serve_one(plain, prompt, params).token_ids


def test_a_small_swa_pool_evicts_checkpoints_and_every_request_finishes_the_same(tiny_checkpoint):
    # Three running sequences hold 6 of the 8 SWA pages; checkpoints and finished tails share 2.
    scheduler = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    squeezed = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32", scheduler=scheduler,
                                      cache=CacheConfig(num_swa_pages=8))
    plain = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32", scheduler=scheduler,
                                   cache=CacheConfig(enable_prefix_caching=False))
    system = tokens(300, seed=111)
    waves = [[system + tokens(30, seed=120 + 3 * w + i) for i in range(3)] for w in range(3)]

    for wave in waves:
        got, want = run_by_hand(squeezed, wave, params), run_by_hand(plain, wave, params)
        for out, reference in zip(got, want, strict=True):
            assert out.finish_reason == "length" and out.token_ids == reference.token_ids
    assert squeezed.kv.tree.stats()["swa_evictions"] > 0
    assert squeezed.stats()["cached_tokens"] > 0
