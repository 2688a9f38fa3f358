"""Speculative decoding inside the engine's step: verify chunks decided, outputs assembled, next drafts.

A speculating request's decode is a verify chunk (`ScheduledChunk.verify`): its last known token t_c
and its drafts d_1..d_k at positions c .. c + k, one target forward over all of them, every position's
logits kept. The rejection rule (`rejection.verify`, on the device, seeded by the request's seed and
output counter) accepts a prefix d_1..d_a and emits it with one more token: the correction, or the
bonus when all k were accepted. The step's output then holds one row per emitted token, and the
scheduler marks positions c .. c + a computed (`Scheduler.after_step`).

Exact rollback is what the pools already do for chunked work: every row a rejected draft's position
wrote (SWA rows, the compressors' state rows, C4 / C128 entries and indexer keys of windows it
closed) is indexed by position and is rewritten, from the accepted token, before any query reads it,
since a query at p reads rows of positions <= p only and the next verify chunk starts at c + a + 1.
Nothing reaches the prefix cache before a request releases its pages, and then only its computed
(accepted) full pages: no block of a rejected draft is ever published.

Who speculates: requests whose tokens follow from the logits alone (`speculates_with`); grammars,
penalties, logit bias, min_tokens, prompt logits / hidden states and routing replay decode as before.
Their routed experts (R3) are reported for accepted positions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from antumbra.config import EngineConfig

from ..core import EngineCore
from ..late_tokens import LateRead
from ..model.forward_batch import to_device
from ..model.fp8_linear import pack_fp8_linears
from ..model.mtp import MTPBlock
from ..model.numerics import Numerics
from ..model.packed_experts import pack_experts
from ..plan import DecodePath, ExecutionPlan, ExpertFormat, LinearFormat
from ..request import Request
from ..sampler import gather_logprobs
from ..sampling_cuts import temperature
from ..sampling_params import SamplingParams
from ..step_io import Drafts, RunnerOutput, ScheduledChunk, SchedulerOutput
from ..step_result import StepResult, VerifiedRows
from .draft_vocab import DraftHead, load_token_map
from .drafter import Drafter, DraftWork, MTPDrafter
from .mtp_loading import load_mtp
from .rejection import verify


def speculates_with(request: Request) -> bool:
    """Whether a request's tokens may be decided by the rejection rule: nothing but temperature and
    the top-k / top-p / min_p cut shapes its distribution, and nothing is wanted per prompt position."""
    p: SamplingParams = request.params
    return (
        p.grammar is None and not p.logit_bias and p.presence_penalty == 0 and p.frequency_penalty == 0
        and p.repetition_penalty == 1 and p.min_tokens == 0 and not request.rollout.wants_prompt_rows
        and request.rollout.replay_experts is None and request.handoff is None
    )


@dataclasses.dataclass(frozen=True)
class _Emitted:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    num_accepted: int


class MTPSpeculation:
    """The runner's `Speculation`: decides verify chunks and drafts with a `Drafter`."""

    def __init__(self, drafter: Drafter, eos_token_ids: Sequence[int]) -> None:
        self.drafter = drafter
        self.num_drafts = drafter.num_drafts
        self.eos_token_ids = frozenset(eos_token_ids)
        self.fuse = True  # launch the draft cycle behind its verify step where the step qualifies

    def admits(self, request: Request) -> bool:
        return speculates_with(request)

    def active(self, step: SchedulerOutput) -> bool:
        return step.speculate and any(c.request.spec is not None for c in step.chunks)

    def release(self, request_id: str) -> None:
        self.drafter.release(request_id)

    def check_integrity(self, live: set[str]) -> None:
        self.drafter.check_integrity(live)

    def after_verify(self, chunks: list[ScheduledChunk], verified: VerifiedRows,
                     argmax: torch.Tensor) -> LateRead:
        """Start a greedy verify step's argmax (argmax [R] int64, device) on its way to the host, then,
        where every chunk is a verify chunk of k drafts, launch the next draft cycle behind the step
        (`MTPDrafter.launch_after_verify`), so the host reads the verdict while the drafter runs ->
        the argmax as row 0 of a late read."""
        read = LateRead.start(argmax[None])
        if isinstance(self.drafter, MTPDrafter) and self.fuse and all(
                c.verify and len(c.draft_ids) == self.num_drafts and c.request.spec is not None
                and c.request.keeps_streams for c in chunks):
            self.drafter.launch_after_verify([c.request.request_id for c in chunks],
                                             [c.start for c in chunks], verified)
        return read

    def finish(self, chunks: list[ScheduledChunk], result: StepResult, drawn: RunnerOutput) -> RunnerOutput:
        emitted = self._verify([c for c in chunks if c.verify], result)
        normal = iter(zip(drawn.requests, drawn.token_ids, drawn.logprobs, strict=True))
        requests: list[Request] = []
        token_ids: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        sampled: dict[str, int] = {}
        for chunk in chunks:
            if chunk.samples:
                request, token, lp = next(normal)
                requests.append(request)
                token_ids.append(token)
                logprobs.append(lp)
                sampled[request.request_id] = token
            elif chunk.verify:
                out = emitted[chunk.request.request_id]
                requests += [chunk.request] * len(out.tokens)
                token_ids += out.tokens
                logprobs += out.logprobs
        experts = dict(drawn.routed_experts)
        for rid, out in emitted.items():  # R3: the accepted positions' routing only
            if rid in experts:
                experts[rid] = experts[rid][: out.num_accepted + 1]
        work = [w for c in chunks if (w := self._work(c, result, emitted, sampled)) is not None]
        return dataclasses.replace(
            drawn, requests=tuple(requests), token_ids=tuple(token_ids), logprobs=tuple(logprobs),
            routed_experts=experts, num_accepted={rid: out.num_accepted for rid, out in emitted.items()},
            drafts=self.drafter.draft(work),
        )

    def _verify(self, chunks: list[ScheduledChunk], result: StepResult) -> dict[str, _Emitted]:
        """The rejection rule over the verify chunks, batched by draft count; where the decode graph's
        race already took each greedy position's argmax, on the host from those."""
        by_count: dict[int, list[ScheduledChunk]] = {}
        emitted: dict[str, _Emitted] = {}
        for chunk in chunks:
            best = result.verify_argmax.get(chunk.request.request_id)
            if best is not None and temperature(chunk.request.params) == 0:
                emitted[chunk.request.request_id] = _greedy(chunk, best, result)
            else:
                by_count.setdefault(len(chunk.draft_ids), []).append(chunk)
        for k, group in by_count.items():
            requests = [c.request for c in group]
            logits = torch.stack([result.verify_logits[r.request_id] for r in requests])  # [B, k + 1, V]
            params = [r.params for r in requests]
            # Greedy rows decide by the argmax alone (`rejection.verify`): their draft
            # distributions are not read.
            vocab = logits.shape[-1]
            q = logits.new_empty(0) if all(temperature(p) == 0 for p in params) else torch.stack(
                [_drafts(r).distributions(vocab, logits.device)[:k] for r in requests])  # [B, k, V]
            drafts = to_device([d for c in group for d in c.draft_ids], logits.device).view(len(group), k)
            verdict = verify(logits, q, drafts, params, [r.seed for r in requests],
                             [r.num_output_tokens for r in requests])
            decided = torch.cat([verdict.num_accepted[:, None], verdict.tokens], dim=1).tolist()  # one read
            for b, request in enumerate(requests):
                accepted = decided[b][0]
                tokens = decided[b][1 : accepted + 2]
                lps = gather_logprobs(logits[b, : len(tokens)], [request.params] * len(tokens), tokens)
                emitted[request.request_id] = _Emitted(tokens, lps, accepted)
        return emitted

    def _work(self, chunk: ScheduledChunk, result: StepResult, emitted: dict[str, _Emitted],
              sampled: dict[str, int]) -> DraftWork | None:
        """What the drafter does for the chunk's request: catch up over its kept positions, then draft
        when the step gave it a new token."""
        request = chunk.request
        streams = result.streams.get(request.request_id)
        if request.spec is None or streams is None:
            return None
        if chunk.verify:
            new = emitted[request.request_id].tokens
            start, hidden, next_ids = chunk.start, streams[: len(new)], new
        else:
            new = [sampled[request.request_id]] if chunk.samples else []
            start = chunk.stop - streams.shape[0]
            next_ids = request.token_ids_range(start + 1, min(chunk.stop + 1, request.num_tokens)) + new
            hidden = streams
        num_tokens = request.num_tokens + len(new)
        return DraftWork(request.request_id, start, hidden, next_ids, self._count(request, new, num_tokens),
                         request.params, request.seed, request.num_output_tokens + len(new), num_tokens)

    def catch_up(self, request: Request, hidden: torch.Tensor) -> Drafts | None:
        """Drafts for a request whose prompt (and first token) another engine computed: the catch-up
        over that engine's streams at the prompt's last positions, as after a last chunk of its own."""
        start = request.num_computed_tokens - hidden.shape[0]
        new = request.output_token_ids[-1:]
        num_tokens = request.num_tokens
        next_ids = request.token_ids_range(start + 1, num_tokens)
        work = DraftWork(request.request_id, start, hidden, next_ids, self._count(request, new, num_tokens),
                         request.params, request.seed, request.num_output_tokens, num_tokens)
        return self.drafter.draft([work]).get(request.request_id)

    def _count(self, request: Request, new: list[int], num_tokens: int) -> int:
        """Drafts to make after `new` tokens: none when there are none, one ended the request or no
        room is left."""
        ended = any(t in self.eos_token_ids or t in request.params.stop_token_ids for t in new)
        room = request.max_total_tokens - num_tokens
        return 0 if not new or ended else max(0, min(self.num_drafts, room))


def _greedy(chunk: ScheduledChunk, best: list[int], result: StepResult) -> _Emitted:
    """The rule on a greedy verify chunk (`rejection.verify`): accept drafts while each is the target's
    argmax at its position (best [k + 1]), then emit the argmax where they part (or the bonus)."""
    drafts = chunk.draft_ids
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    tokens = best[: accepted + 1]
    params = chunk.request.params
    logprobs: list[dict[int, float] | None] = [None] * len(tokens)
    if params.logprobs is not None:
        logits = result.verify_logits[chunk.request.request_id]
        logprobs = gather_logprobs(logits[: len(tokens)], [params] * len(tokens), tokens)
    return _Emitted(tokens, logprobs, accepted)


def _drafts(request: Request) -> Drafts:
    assert request.spec is not None and request.spec.drafts is not None
    drafts: Drafts = request.spec.drafts
    return drafts


def start_speculation(core: EngineCore, block: MTPBlock | None) -> None:
    """Turn on the core's speculation as its config says (nothing when `speculative.tokens` is 0)."""
    config = core.config.speculative
    if config.tokens == 0:
        return
    if block is None:
        raise ValueError("speculative decoding needs the checkpoint's MTP block "
                         "(num_nextn_predict_layers > 0): this model has none")
    weight = core.model.lm_head.weight
    # The block keeps the dtypes it was loaded in (the serving dtype, float32 where the target keeps it:
    # the hyper-connections' mixing weights the mHC kernels read).
    block = prepare_block(block.to(device=weight.device).eval(), core.plan)
    max_seqs = core.config.scheduler.max_num_seqs
    sizes: tuple[int, ...] = ()
    if core.plan.decode is not DecodePath.GENERAL:  # the drafter's steady step on the fixed-shape path
        most = min(max_seqs, config.max_batch)
        sizes = tuple(b for b in core.config.fast.cuda_graph_batch_sizes if b <= most) or (most,)
    head = DraftHead(weight, load_token_map(config.token_map)) if config.token_map else None
    drafter = MTPDrafter(core.model, block, config.tokens, max_seqs, sizes,
                         use_graphs=core.plan.decode is DecodePath.GRAPHS, head=head)
    core.enable_speculation(MTPSpeculation(drafter, core.eos_token_ids), config)


def prepare_block(block: MTPBlock, plan: ExecutionPlan) -> MTPBlock:
    """The draft block in the target's weight formats and numerics (packing is in place)."""
    if plan.expert_format is ExpertFormat.MXFP4:
        pack_experts(block)
    if plan.linear_format is LinearFormat.FP8:
        pack_fp8_linears(block)
    block.set_numerics(Numerics.of(plan.numerics.value))
    return block


def draft_block(path: str | Path, config: EngineConfig, dtype: torch.dtype, device: str) -> MTPBlock | None:
    """The checkpoint's first MTP block when the config speculates, else None (`load_mtp` refuses a
    checkpoint without one, naming it)."""
    if config.speculative.tokens == 0:
        return None
    return load_mtp(path, dtype=dtype, device=device)
