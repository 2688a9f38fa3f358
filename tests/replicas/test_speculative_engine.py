"""Speculative decoding in the engine: with the MTP block drafting 1, 3 or 5 tokens a step, greedy
output equals the engine's own non-speculative output (tokens, and logprobs within 1e-5 in float32)
across window and compression boundaries, with prefix-cache hits, chunked prefill, preemption in the
middle of speculation, HiSparse, batch-invariant mode, routed-expert reports and the release's numerics;
`check_integrity()` holds after every step and no block of a rejected draft is ever published.

The target is the distilled tiny model (`distilled_checkpoint`: window 8, compression rates 4 and 8), so
drafts are accepted often and both the accept and the reject branch run in every case.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from antumbra.cachestore.block_hash import BlockStored, block_hashes
from antumbra.config import CacheConfig, SchedulerConfig
from antumbra.replicas.engine import Engine
from antumbra.replicas.request import RequestOutput
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.rl.mtp_distill import DISTILL_SPEC, random_prompts
from tests.replicas.stepping import run_by_hand

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
TOKEN_IDS = (2, DISTILL_SPEC.padded_vocab_start)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    return random_prompts(count, length, TOKEN_IDS, seed)


def build(path: Path, k: int, **kwargs) -> Engine:
    """Speculating at every batch these tests run (the default cap is the GPU's measured one)."""
    kwargs.setdefault("speculative_max_batch", 16)
    return Engine.from_pretrained(path, device="cpu", dtype="float32", speculative_tokens=k, **kwargs)


class Published:
    """Every block hash the engine's cache announced."""

    def __init__(self, engine: Engine) -> None:
        self.hashes: set[int] = set()
        engine.core.subscribe(self._on_event)

    def _on_event(self, seq: int, event) -> None:
        if isinstance(event, BlockStored):
            self.hashes.update(event.hashes)


def chosen_logprobs(out: RequestOutput) -> torch.Tensor:
    assert out.logprobs is not None
    return torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)])


def assert_same_output(got: list[RequestOutput], want: list[RequestOutput], atol: float = 1e-5) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        if w.logprobs is not None:
            torch.testing.assert_close(chosen_logprobs(g), chosen_logprobs(w), atol=atol, rtol=0)


def assert_both_branches_ran(outs: list[RequestOutput]) -> None:
    drafted = sum(o.num_drafted_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted


def assert_only_accepted_blocks_published(engine: Engine, published: Published, batch: list[list[int]],
                                          outs: list[RequestOutput]) -> None:
    page = engine.pools.layout.page_size
    allowed = {h for p, o in zip(batch, outs, strict=True)
               for h in block_hashes(p + o.token_ids, page, "default")}
    assert published.hashes, "nothing was cached: the check would prove nothing"
    assert published.hashes <= allowed, "a block holding a rejected draft was published"


@pytest.fixture(scope="module")
def plain(distilled_checkpoint: Path) -> Engine:
    return build(distilled_checkpoint, 0)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_plain_decoding(distilled_checkpoint: Path, plain: Engine, k: int) -> None:
    # Lengths around the window (8) and both compression rates (4, 8); decoding crosses many more.
    batch = [p[:n] for p, n in zip(prompts(4, 40, seed=11), (9, 16, 23, 40), strict=True)]
    want = run_by_hand(plain, batch, GREEDY)
    engine = build(distilled_checkpoint, k)
    published = Published(engine)
    got = run_by_hand(engine, batch, GREEDY)
    assert_same_output(got, want)
    assert_both_branches_ran(got)
    assert all(o.num_drafted_tokens % 1 == 0 and o.num_accepted_tokens <= o.num_drafted_tokens for o in got)
    assert_only_accepted_blocks_published(engine, published, batch, got)


def test_prefix_hits_and_chunked_prefill(distilled_checkpoint: Path) -> None:
    shared = prompts(1, 48, seed=21)[0]
    first, second = shared[:40], shared + prompts(1, 11, seed=22)[0]
    scheduler = SchedulerConfig(max_prefill_chunk_tokens=5, max_num_batched_tokens=64)
    outs = {}
    for k in (0, 3):
        engine = build(distilled_checkpoint, k, scheduler=scheduler)
        outs[k] = run_by_hand(engine, [first], GREEDY) + run_by_hand(engine, [second], GREEDY)
    assert outs[3][1].cached_tokens > 0
    assert_same_output(outs[3], outs[0])
    assert_both_branches_ran(outs[3])


def test_a_prefix_hit_leaves_the_drafters_window_to_compute(distilled_checkpoint: Path) -> None:
    """The cache keeps the target's KV, not the MTP block's window: a speculating request's hit stops a
    window short of its prompt's end, so the drafter catches up over the target's own states and drafts
    after a hit exactly as after computing the whole prompt; a plain request's hit reaches its last page."""
    prompt = prompts(1, 33, seed=24)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = build(distilled_checkpoint, 3)
    page, window = engine.pools.layout.page_size, engine.model_config.sliding_window
    cold = run_by_hand(engine, [prompt], params)[0]
    hit = run_by_hand(engine, [prompt], params)[0]
    assert hit.cached_tokens == (len(prompt) - window) // page * page > 0
    assert hit.token_ids == cold.token_ids
    assert (hit.num_drafted_tokens, hit.num_accepted_tokens) == (cold.num_drafted_tokens,
                                                                 cold.num_accepted_tokens)
    assert 0 < cold.num_accepted_tokens
    plain = build(distilled_checkpoint, 0)
    run_by_hand(plain, [prompt], params)
    assert run_by_hand(plain, [prompt], params)[0].cached_tokens == (len(prompt) - 1) // page * page


def test_preemption_in_the_middle_of_speculation(distilled_checkpoint: Path, plain: Engine) -> None:
    params = SamplingParams(max_tokens=90, temperature=0.0, logprobs=0, ignore_eos=True)
    batch = prompts(6, 30, seed=31)
    scheduler = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256)
    want = run_by_hand(build(distilled_checkpoint, 0, scheduler=scheduler), batch, params)
    tight = build(distilled_checkpoint, 3, scheduler=scheduler, cache=CacheConfig(num_virtual_tokens=24 * 16))
    drafts_dropped = []

    def watch() -> None:  # a preempted request recomputes from its prompt: its drafts must be gone
        drafts_dropped.extend(
            r.spec.drafts is None for r in tight.scheduler.waiting if r.num_preemptions and r.spec is not None
        )

    got = run_by_hand(tight, batch, params, watch)
    assert tight.stats()["preemptions"] > 0
    assert drafts_dropped and all(drafts_dropped)
    assert_same_output(got, want)
    assert_both_branches_ran(got)


def test_hisparse(distilled_checkpoint: Path) -> None:
    batch = prompts(3, 36, seed=41)
    cache = CacheConfig(hisparse_rows_per_request=8)
    want = run_by_hand(build(distilled_checkpoint, 0, cache=cache), batch, GREEDY)
    engine = build(distilled_checkpoint, 3, cache=cache)
    assert engine.pools.hot is not None
    got = run_by_hand(engine, batch, GREEDY)
    assert_same_output(got, want)
    assert_both_branches_ran(got)


def test_release_numerics(distilled_checkpoint: Path) -> None:
    batch = prompts(3, 20, seed=51)
    want = run_by_hand(build(distilled_checkpoint, 0, numerics="release"), batch, GREEDY)
    got = run_by_hand(build(distilled_checkpoint, 3, numerics="release"), batch, GREEDY)
    assert_same_output(got, want)
    assert_both_branches_ran(got)


def test_batch_invariant_mode_is_bitwise_the_same(distilled_checkpoint: Path) -> None:
    batch = prompts(3, 20, seed=61)
    want = run_by_hand(build(distilled_checkpoint, 0, deterministic=True), batch, GREEDY)
    got = run_by_hand(build(distilled_checkpoint, 3, deterministic=True), batch, GREEDY)
    assert_same_output(got, want, atol=0.0)
    assert_both_branches_ran(got)


def test_routed_experts_are_those_of_the_accepted_tokens(distilled_checkpoint: Path, plain: Engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, return_routed_experts=True, ignore_eos=True)
    batch = prompts(2, 18, seed=71)
    want = run_by_hand(plain, batch, params)
    got = run_by_hand(build(distilled_checkpoint, 3), batch, params)
    assert_same_output(got, want)
    assert_both_branches_ran(got)
    for g, w in zip(got, want, strict=True):
        assert g.routed_experts is not None and w.routed_experts is not None
        assert g.routed_experts.shape[0] == len(batch[0]) + params.max_tokens - 1
        assert torch.equal(g.routed_experts, w.routed_experts)


def test_seeded_sampling_repeats_and_other_seeds_differ(distilled_checkpoint: Path) -> None:
    engine = build(distilled_checkpoint, 3)
    prompt = prompts(1, 16, seed=81)[0]

    def draw(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=30, temperature=1.0, top_k=8, seed=seed, ignore_eos=True)
        return run_by_hand(engine, [prompt], params)[0].token_ids

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_above_the_batch_threshold_nothing_is_drafted(distilled_checkpoint: Path, plain: Engine) -> None:
    from antumbra.config import SpeculativeConfig

    batch = prompts(3, 16, seed=91)
    want = run_by_hand(plain, batch, GREEDY)
    engine = build(distilled_checkpoint, 3)
    engine.core.scheduler.speculative = SpeculativeConfig(tokens=3, max_batch=2)
    got = run_by_hand(engine, batch, GREEDY)
    assert_same_output(got, want)
    # Three decode at once until the first finishes: above the threshold of 2, no verify chunk runs.
    assert all(o.num_drafted_tokens == 0 for o in got)


def test_a_checkpoint_without_an_mtp_block_cannot_speculate(tmp_path: Path) -> None:
    from dataclasses import replace

    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    spec = replace(DISTILL_SPEC, num_mtp_layers=0)
    path = make_tiny_checkpoint(tmp_path / "plain", spec, with_tokenizer=False)
    with pytest.raises(ValueError, match="MTP block"):
        build(path, 2)
    with pytest.raises(ValueError, match="speculative tokens"):
        build(path, 9)


@pytest.mark.parametrize("keep_rate", [0.0, 0.6, 1.0])
def test_replayed_drafts_accept_at_their_keep_rate(distilled_checkpoint: Path, plain: Engine,
                                                    keep_rate: float) -> None:
    from antumbra.config import SpeculativeConfig
    from antumbra.replicas.speculative.engine_step import MTPSpeculation
    from antumbra.replicas.speculative.replay import ReplayDrafter

    batch = prompts(2, 16, seed=101)
    want = run_by_hand(plain, batch, GREEDY)
    engine = build(distilled_checkpoint, 0)
    rids = ["a", "b"]
    references = {rid: w.token_ids for rid, w in zip(rids, want, strict=True)}
    drafter = ReplayDrafter(references.get, 3, keep_rate, engine.model_config.vocab_size, "cpu")
    engine.core.enable_speculation(MTPSpeculation(drafter, engine.eos_token_ids),
                                   SpeculativeConfig(tokens=3, max_batch=2))
    for rid, prompt in zip(rids, batch, strict=True):
        engine.core.add_request(prompt, GREEDY, request_id=rid)
    got = {}
    while engine.core.has_work():
        got.update({o.request_id: o for o in engine.core.step() if o.finished})
        engine.check_integrity()
    assert_same_output([got[r] for r in rids], want)
    drafted = sum(got[r].num_drafted_tokens for r in rids)
    accepted = sum(got[r].num_accepted_tokens for r in rids)
    assert drafted > 0
    if keep_rate == 1.0:
        assert accepted == drafted
    elif keep_rate == 0.0:
        assert accepted == 0
    else:
        assert 0 < accepted < drafted


def test_sampled_speculation_follows_the_target_distribution(distilled_checkpoint: Path) -> None:
    """20,000 seeded requests of one prompt, two tokens each: the second is the first the verify chunk
    decides. Among the draws whose first token was the most frequent one (a fixed context), the second
    token's counts against the target's distribution there (chi-square, p > 0.01)."""
    from collections import Counter

    from antumbra.replicas.build import load_model
    from antumbra.replicas.speculative.plain_forward import plain_forward
    from antumbra.replicas.speculative.rejection import sampling_probs
    from tests.replicas.test_speculative_sampling import chi_square_p_value

    draws, per_call = 20_000, 2_000
    prompt = prompts(1, 16, seed=111)[0]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=2, temperature=1.0, top_k=8, seed=seed, ignore_eos=True)

    # Every request speculates however many decode at once (the default pauses above 16).
    engine = build(distilled_checkpoint, 3, scheduler=SchedulerConfig(max_num_seqs=256),
                   speculative_max_batch=256)
    outs = []
    for start in range(0, draws, per_call):
        outs += engine.generate([prompt] * per_call, [params(s) for s in range(start, start + per_call)])
    assert sum(o.num_drafted_tokens > 0 for o in outs) == draws  # every second token was verified
    first = Counter(o.token_ids[0] for o in outs).most_common(1)[0][0]
    second = torch.tensor([o.token_ids[1] for o in outs if o.token_ids[0] == first])
    model = load_model(distilled_checkpoint, "cpu", torch.float32, progress=False).model
    want = sampling_probs(plain_forward(model, prompt + [first]).logits[-1:], [params(0)])[0]
    assert second.numel() > 2_000
    assert chi_square_p_value(torch.bincount(second, minlength=want.numel()), want, second.numel()) > 0.01
    # A wrong distribution over the same tokens (uniform) is told apart at this size.
    uniform = (want > 0).float() / (want > 0).sum()
    assert chi_square_p_value(torch.bincount(second, minlength=want.numel()), uniform, second.numel()) < 1e-6


def test_verify_chunks_on_the_general_steps_kernels(distilled_checkpoint: Path) -> None:
    """The path verify chunks take on a GPU (the general step through the Triton kernels, interpreted
    here): several sequences' verify chunks in one step give the plain engine's tokens."""
    from antumbra.config import FastPathConfig

    fast = FastPathConfig(decode="off", general_kernels="on")
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    batch = prompts(2, 14, seed=121)
    want = run_by_hand(build(distilled_checkpoint, 0, fast=fast), batch, params)
    got = run_by_hand(build(distilled_checkpoint, 3, fast=fast), batch, params)
    assert_same_output(got, want)
    assert_both_branches_ran(got)


@pytest.mark.parametrize("chunk_tokens", [None, 6], ids=["one_chunk", "chunked"])
def test_a_decode_replica_drafts_after_adoption_as_one_engine_does(
        distilled_checkpoint: Path, plain: Engine, chunk_tokens: int | None) -> None:
    """Prefill / decode handoff: the prefill engine computes the prompt and its first token and sends
    the streams at the prompt's last window with the KV; the speculating decode engine catches its
    drafter up over them, so it drafts, accepts and emits exactly what one speculating engine does
    (prompts of 20 tokens, window 8, in one chunk or in chunks of 6 whose streams the sender joins;
    the first prompt again, a prefix hit at both ends that leaves the sender a window to compute)."""
    from antumbra.replicas.kv_transfer.payload import DRAFT_STREAMS
    from tests.replicas.test_kv_transfer import run_pd

    cache = CacheConfig(num_virtual_tokens=4096)
    scheduler = SchedulerConfig(max_prefill_chunk_tokens=chunk_tokens) if chunk_tokens else SchedulerConfig()
    prefill = build(distilled_checkpoint, 0, cache=cache, scheduler=scheduler)
    decode = build(distilled_checkpoint, 3, cache=cache, scheduler=scheduler)
    window = decode.model_config.sliding_window
    batch = prompts(3, 20, seed=131)
    for i, prompt in enumerate([*batch, batch[0]]):
        want = run_by_hand(plain, [prompt], GREEDY)[0]
        alone = build(distilled_checkpoint, 3, cache=cache, scheduler=scheduler)
        one = run_by_hand(alone, [prompt], GREEDY)[0]
        got, payload = run_pd(prefill, decode, prompt, GREEDY, rid=f"pd-{i}")
        assert payload.tensors[DRAFT_STREAMS].shape[0] == window
        assert_same_output([got], [want])
        assert (got.num_drafted_tokens, got.num_accepted_tokens) == (one.num_drafted_tokens,
                                                                     one.num_accepted_tokens)
        assert 0 < got.num_accepted_tokens
    assert payload.cached_tokens > 0 and payload.skip_pages > 0


def test_a_context_parallel_prefill_sends_the_drafters_streams(distilled_checkpoint: Path,
                                                                plain: Engine) -> None:
    """A prefill over context-parallel ranks joins the last window's streams from its ranks' tails (13
    tokens over 4 ranks: every slice shorter than the window of 8), and the speculating decode engine
    that adopts it drafts, accepts and emits what one speculating engine does; over gloo threads too."""
    from antumbra.replicas.context_parallel.handoff import cp_prefill_payload, prompt_pools
    from antumbra.replicas.kv_transfer.payload import DRAFT_STREAMS

    cache = CacheConfig(num_virtual_tokens=4096)
    decode = build(distilled_checkpoint, 3, cache=cache)
    pd = decode.disaggregation
    for i, (n, ranks) in enumerate(((13, 4), (20, 2))):
        prompt = prompts(1, n, seed=161 + i)[0]
        want = run_by_hand(plain, [prompt], GREEDY)[0]
        one = run_by_hand(build(distilled_checkpoint, 3, cache=cache), [prompt], GREEDY)[0]
        def pools(n: int = n):
            return prompt_pools(decode.model_config, decode.config, decode.plan, n)

        payload = cp_prefill_payload(decode.model, pools, prompt, ranks, f"cp-{i}", over_gloo=i == 1,
                                     draft_streams=True)
        assert payload.tensors[DRAFT_STREAMS].shape[0] == decode.model_config.sliding_window
        reservation = pd.reserve_adoption(prompt, GREEDY, f"cp-{i}")
        assert reservation.draft_streams
        got = pd.adopt_generate(reservation, payload)
        assert_same_output([got], [want], atol=1e-4)
        assert (got.num_drafted_tokens, got.num_accepted_tokens) == (one.num_drafted_tokens,
                                                                     one.num_accepted_tokens)
    decode.check_integrity()


def test_an_adoption_with_bad_draft_streams_is_refused_and_changes_nothing(
        distilled_checkpoint: Path) -> None:
    """A payload whose drafter streams have the wrong shape is refused before any page is taken; the
    request stays held (its reservation can still be cancelled) and the core is intact."""
    from antumbra.replicas.kv_transfer.adopt import AdoptionError, adopt, cancel, reserve
    from antumbra.replicas.kv_transfer.disaggregation import prefill_params
    from antumbra.replicas.kv_transfer.payload import DRAFT_STREAMS

    prefill, decode = build(distilled_checkpoint, 0), build(distilled_checkpoint, 3)
    prompt = prompts(1, 20, seed=151)[0]
    held = decode.core.make_request(prompt, GREEDY, "bad")
    reserve(decode.core, held)
    prefill.core.add(prefill.core.make_request(prompt, prefill_params(GREEDY), "bad", export_kv_from=0,
                                               export_draft_streams=True))
    payload = next(o.kv_export for o in prefill.core.run_until_finished(["bad"]))
    streams = payload.tensors[DRAFT_STREAMS]
    bad = dataclasses.replace(payload, tensors={**payload.tensors, DRAFT_STREAMS: streams[1:]})
    free_before = decode.pools.num_free_virtual_pages
    with pytest.raises(AdoptionError, match=DRAFT_STREAMS):
        adopt(decode.core, held, bad)
    assert held in decode.core.scheduler.held and decode.pools.num_free_virtual_pages == free_before
    decode.check_integrity()
    cancel(decode.core, held)
    decode.check_integrity()


def test_verify_chunks_on_the_fixed_shape_step(distilled_checkpoint: Path) -> None:
    """The path verify chunks take on a GPU with decode graphs: every speculating step's tokens as rows
    of the fixed-shape decode step (a verify chunk's k + 1 positions as rows of one sequence, the kernels
    interpreted here, run eagerly), its written rows checked against the page tables; the tokens and
    logprobs are the plain engine's on the same path, and windows close inside verify chunks."""
    from antumbra.config import FastPathConfig

    fast = FastPathConfig(decode="on", cuda_graph_batch_sizes=(1, 2, 4, 8, 16))
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=0, ignore_eos=True)
    batch = [p[:n] for p, n in zip(prompts(2, 14, seed=141), (6, 14), strict=True)]
    want = run_by_hand(build(distilled_checkpoint, 0, fast=fast), batch, params)
    engine = build(distilled_checkpoint, 3, fast=fast)
    graphs = engine.runner.fast
    assert graphs is not None and graphs.max_batch_size == 16  # 4 requests x (3 drafts + 1) rows fit
    graphs.validate = True
    verified_rows: list[int] = []
    run_verify = graphs.run_verify

    def counted(chunks, greedy=False):
        verified_rows.append(sum(c.num_new_tokens for c in chunks))
        return run_verify(chunks, greedy)

    graphs.run_verify = counted  # type: ignore[method-assign]
    got = run_by_hand(engine, batch, params)
    assert_same_output(got, want)
    assert_both_branches_ran(got)
    assert max(verified_rows) > len(batch), "no step ran several positions of one request as rows"
    # The drafter's steady steps ran as the fixed-shape draft step, and drafted what the eager
    # drafter of the general path drafts: most cycles launched behind their verify step (the device
    # deciding which rows were accepted), the others (fewer than k drafts near the end) after the
    # host read the verdict.
    speculation = engine.core.runner.speculation
    assert speculation is not None
    drafter = speculation.drafter  # type: ignore[attr-defined]
    assert 0 < drafter.graphs.num_after_verify < drafter.graphs.num_steps
    eager = run_by_hand(build(distilled_checkpoint, 3), batch, params)
    assert [o.num_accepted_tokens for o in got] == [o.num_accepted_tokens for o in eager]
    # Each cycle run after the host read its verify step's verdict instead: the same output, and
    # the MTP block's window rows written bitwise equal (inactive rows write only the scratch row).
    after = build(distilled_checkpoint, 3, fast=fast)
    after.core.runner.speculation.fuse = False  # type: ignore[union-attr]
    assert_same_output(run_by_hand(after, batch, params), got, atol=0.0)
    after_drafter = after.core.runner.speculation.drafter  # type: ignore[union-attr]
    assert after_drafter.graphs.num_after_verify == 0 and after_drafter.graphs.num_steps > 0
    rows, after_rows = drafter.cache.pools.swa_kv, after_drafter.cache.pools.swa_kv
    live = torch.ones(rows.shape[1], dtype=torch.bool)
    live[drafter.cache.pools.scratch_swa_row] = False
    assert torch.equal(rows[:, live], after_rows[:, live])


def test_speculation_grows_the_decode_graphs_to_the_verify_rows(distilled_checkpoint: Path) -> None:
    from antumbra.config import FastPathConfig, SpeculativeConfig
    from antumbra.replicas.speculative.engine_step import MTPSpeculation
    from antumbra.replicas.speculative.replay import ReplayDrafter

    fast = FastPathConfig(decode="on", cuda_graph_batch_sizes=(1, 2, 4, 8, 16))
    engine = build(distilled_checkpoint, 0, fast=fast, scheduler=SchedulerConfig(max_num_seqs=2))
    assert engine.runner.fast is not None and engine.runner.fast.max_batch_size == 2
    drafter = ReplayDrafter(lambda rid: None, 3, 1.0, engine.model_config.vocab_size, "cpu")
    engine.core.enable_speculation(MTPSpeculation(drafter, engine.eos_token_ids),
                                   SpeculativeConfig(tokens=3, max_batch=2))
    graphs = engine.runner.fast
    assert graphs is not None and graphs.max_batch_size == 8  # 2 requests x (3 drafts + 1) rows
    assert engine.core.overlap.fast is graphs


def test_the_draft_block_keeps_float32_mixing_weights_in_bfloat16(distilled_checkpoint: Path) -> None:
    """The mHC kernels read the hyper-connections' mixing weights in float32, the target's and the draft
    block's alike: speculation's setup moves the block to the device without casting them."""
    engine = Engine.from_pretrained(distilled_checkpoint, device="cpu", dtype="bfloat16",
                                    speculative_tokens=3)
    speculation = engine.core.runner.speculation
    assert speculation is not None
    block = speculation.drafter.block  # type: ignore[attr-defined]
    assert block.layer.attn_hc.fn.dtype == torch.float32 and block.hc_head.hc_fn.dtype == torch.float32
    assert block.e_proj.weight.dtype == torch.bfloat16
