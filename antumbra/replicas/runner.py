"""The model runner: runs a scheduled step and draws its tokens, changing no request.

`execute(SchedulerOutput) -> RunnerOutput` turns the step's chunks into the model's batch
description, runs the forward (the general step, or the fixed-shape decode step / its CUDA
graphs; a step of decode rows beside prefill chunks runs its decode rows fixed-shape and the rest
on the general step, `ModelRunner._mixed`, or, with prompt rows on, wholly fixed-shape when its
prompt chunks are short, `ModelRunner._prompt_rows`), and draws the sampling rows' tokens: in the decode
graph when the rows are plain, else with the sampler, under the structured-output masks computed
on the mask worker meanwhile. Its overlap stepper (`overlap.py`) launches pure-decode steps, and
prompt rows steps of plain rows, whose tokens are read a step later.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import ModelConfig

from . import decode_rows
from .decode_graphs import DecodeGraphs
from .late_tokens import LateRead
from .model.forward_batch import ForwardBatch, to_device
from .model.model import DeepseekV4
from .overlap import OverlapStepper
from .penalty_state import PenalisedRow, PenaltyState, needs_slot
from .request import Request
from .sampler import Sampler, SamplingRows, gather_logprobs
from .sampling_cuts import temperature
from .sampling_params import SamplingParams
from .step_io import (
    Drafts,
    OutputKind,
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
    kept_streams,
    one_by_one,
)
from .step_result import StepResult, VerifiedRows, merged_results
from .structured.masks import MaskBuilder, PendingMask


class Speculation(Protocol):
    """Speculative decoding as the runner uses it (`speculative/engine_step.py`)."""

    def admits(self, request: Request) -> bool:
        """Whether a new request speculates."""

    def active(self, step: SchedulerOutput) -> bool:
        """Whether the step verifies or drafts (it then runs the general step, keeping streams)."""

    def finish(self, chunks: list[ScheduledChunk], result: StepResult, drawn: RunnerOutput) -> RunnerOutput:
        """The step's output with its verify chunks decided and the next drafts made."""

    def after_verify(self, chunks: list[ScheduledChunk], verified: VerifiedRows,
                     argmax: torch.Tensor) -> LateRead:
        """A greedy fixed-shape verify step's argmax reader; the next drafts may be launched behind it."""

    def catch_up(self, request: Request, hidden: torch.Tensor) -> Drafts | None:
        """Drafts for a request whose prompt another engine computed, from that engine's streams at
        its last positions (`hidden` [m, n, D]); None when it drafts nothing."""

    def release(self, request_id: str) -> None:
        """Forget a request that finished."""

    def check_integrity(self, live: set[str]) -> None: ...


class ModelRunner:
    """`separate`: batch-invariant mode, where every chunk is one token: each runs in the fixed-shape
    step at its one padded size where that step takes it, else as a forward of its own, so no
    chunk's arithmetic depends on what else is in the step (`_run_invariant`). `overlap`: pure
    decode steps may be launched before the previous step's tokens are read (`overlap.py`). `mixed`:
    a step's decode rows run fixed-shape beside its other chunks on the general step (`_mixed`).
    `prompt_rows`: a step whose prompt chunks fit the fixed-shape step's rows runs there whole
    (`_prompt_rows`)."""

    def __init__(
        self, model: DeepseekV4, pools: KVPools, device: torch.device, fast: DecodeGraphs | None = None,
        separate: bool = False, sampler: Sampler | None = None, penalties: PenaltyState | None = None,
        overlap: bool = False, mixed: bool = False, prompt_rows: bool = False,
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        self.fast = fast
        self.separate = separate
        self.mixed = mixed  # decode rows beside other chunks on the fixed-shape step (`_mixed`)
        self.prompt_rows = prompt_rows  # short prompt chunks as fixed-shape rows too (`_prompt_rows`)
        self.sampler = sampler if sampler is not None else Sampler(use_kernel=False)
        self.penalties = penalties  # penalised requests' device-resident counts (`penalty_state.py`)
        self.masks: MaskBuilder | None = None  # structured output's mask worker, made on first use
        self.overlap = OverlapStepper(fast, overlap, self.start_masks)
        self.speculation: Speculation | None = None  # speculative decoding, when it is on (`speculative/`)
        self.num_mixed_steps = 0  # steps whose decode rows ran fixed-shape beside a general forward
        self.num_prompt_row_steps = 0  # steps whose prompt chunks ran as rows of the fixed-shape step
        self.num_prompt_rows_drawn_in_graph = 0  # of those, steps whose tokens the graph's race drew

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Run the model and sample; changes no request (so a failed step can be re-run)."""
        chunks = list(step.chunks)
        sampling = [c.request for c in chunks if c.samples]
        rows = self._rows(sampling)
        masks = self.start_masks(sampling)  # filled on a worker thread while the forward runs
        speculating = self.speculation is not None and self.speculation.active(step)
        handing = [c.request.request_id for c in chunks
                   if c.request.handoff is not None and c.request.handoff.sends_streams]
        result = self.run(chunks, rows, keep_streams=speculating or bool(handing))
        drawn = RunnerOutput(OutputKind.DRAWN, prompt_logits=result.prompt_logits,
                             prompt_hidden=result.prompt_hidden or {}, routed_experts=result.routed_experts,
                             handoff_streams={r: result.streams[r] for r in handing if r in result.streams})
        if sampling:
            tokens, on_device = result.sampled, None  # a decode graph's draws are counted in the graph
            allowed = masks.result(result.sample_logits.device) if masks is not None else None
            if tokens is None or allowed is not None:
                tokens = on_device = self.sampler.sample_tokens(result.sample_logits, rows, allowed)
            token_ids = tokens.tolist()
            logprobs = gather_logprobs(result.sample_logits, rows.params, token_ids)
            drawn = dataclasses.replace(drawn, requests=tuple(sampling), token_ids=tuple(token_ids),
                                        logprobs=tuple(logprobs), drawn=on_device,
                                        resident=rows.resident if on_device is not None else None)
        if speculating:
            assert self.speculation is not None
            return self.speculation.finish(chunks, result, drawn)
        return drawn

    def launch(self, step: SchedulerOutput) -> RunnerOutput | None:
        """The step launched overlapped (`overlap.py`), as LAUNCHED; None when it does not qualify."""
        overlap = self.overlap
        if not overlap.enabled or (self.speculation is not None and self.speculation.active(step)):
            return None
        rows, chunks = self._rows(step.sampling), list(step.chunks)
        if overlap.eligible(chunks, rows):
            return overlap.launch(step, rows)
        if not (self.prompt_rows and not self.separate and overlap.eligible(chunks, rows, as_rows=True)):
            return None
        self.num_prompt_row_steps += 1
        return overlap.launch(step, rows, as_rows=True)

    def start_masks(self, sampling: list[Request]) -> PendingMask | None:
        """The allowed-token masks of the rows whose request has a grammar (a finished request's
        row is left free: its draw is dropped); None when no row has one."""
        if all(r.grammar is None for r in sampling):
            return None
        if self.masks is None:
            self.masks = MaskBuilder(self.model.config.vocab_size, self.device)
        return self.masks.start([None if r.finished else r.grammar for r in sampling])

    def _rows(self, sampling: list[Request]) -> SamplingRows:
        if not sampling:  # a step of verify chunks and prefill chunks only
            return _NO_ROWS
        resident = self.penalties.rows_for([_penalised(r) for r in sampling]) if self.penalties else None
        return SamplingRows.build(
            [r.params for r in sampling], [r.seed for r in sampling], [r.num_output_tokens for r in sampling],
            resident,
        )

    def build_batch(self, chunks: list[ScheduledChunk], keep_streams: bool = False
                    ) -> tuple[ForwardBatch, list[tuple[int, int, int]]]:
        """-> (batch, per chunk: (first token row, first logits row, first kept stream row)).

        Every index list is built on the host and travels in one asynchronous copy (`to_device`:
        pinned memory on CUDA), so building a step never waits for the step before it."""
        ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        logits_rows: list[int] = []
        stream_rows: list[int] = []
        spans = []
        window = self.model.config.sliding_window
        for b, chunk in enumerate(chunks):
            row0 = len(ids)
            ids.extend(chunk.token_ids())
            positions.extend(range(chunk.start, chunk.stop))
            req_index.extend([b] * chunk.num_new_tokens)
            spans.append((row0, len(logits_rows), len(stream_rows)))
            if _wants_rows(chunk) or chunk.verify:
                logits_rows.extend(range(row0, row0 + chunk.num_new_tokens))
            elif chunk.samples:
                logits_rows.append(row0 + chunk.num_new_tokens - 1)
            if keep_streams and chunk.request.keeps_streams:
                stream_rows.extend(range(row0 + chunk.num_new_tokens - kept_streams(chunk, window),
                                         row0 + chunk.num_new_tokens))
        vpages = tuple(tuple(c.request.kv.vpages) for c in chunks)
        width = max(len(v) for v in vpages)
        tables = [page for v in vpages for page in (*v, *([-1] * (width - len(v))))]  # [B * P]
        lists = [ids, positions, req_index, logits_rows, tables, stream_rows]
        packed = to_device([x for values in lists for x in values], self.device)
        input_ids, pos, req, logits_indices, block_tables, stream_indices = packed.split(
            [len(v) for v in lists])

        replay = None
        if any(c.request.rollout.replay_experts is not None for c in chunks):
            replay = to_device(torch.cat([_replay_rows(c, self.model.config) for c in chunks]), self.device)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            req_index=req,
            block_tables=block_tables.view(len(chunks), width),
            logits_indices=logits_indices,
            spans=tuple((span[0], span[0] + c.num_new_tokens) for span, c in zip(spans, chunks, strict=True)),
            starts=tuple(c.start for c in chunks),
            vpages=vpages,
            replay_until=tuple(c.request.kv.replay_until for c in chunks),
            hot_buffers=tuple(c.request.kv.hot_buffer for c in chunks),
            routed_experts=replay,
            stream_indices=stream_indices if stream_rows else None,
        )
        return batch, spans

    def run(self, chunks: list[ScheduledChunk], rows: SamplingRows, keep_streams: bool = False) -> StepResult:
        """`rows`: the sampling settings of the chunks that sample, in chunk order; `keep_streams`: keep
        the last-layer streams the MTP drafter reads for the speculating requests' chunks."""
        if not keep_streams and self.fast is not None and self.fast.eligible(chunks):
            logits, sampled = self.fast.run(chunks, rows)
            return StepResult(logits, sampled, {}, {})
        if keep_streams and not self.separate and self.fast is not None and self.fast.verifies(chunks):
            return self._verify_fast(chunks)
        if (not keep_streams and self.prompt_rows and not self.separate and self.fast is not None
                and self.fast.takes_prompt_rows(chunks)):
            return self._prompt_rows(chunks, rows)
        if not keep_streams and self.mixed and not self.separate and self.fast is not None:
            mixed = self._mixed(chunks)
            if mixed is not None:
                return mixed
        if self.separate:
            return self._run_invariant(chunks, keep_streams)
        return self._forward(chunks, keep_streams)

    def _verify_fast(self, chunks: list[ScheduledChunk]) -> StepResult:
        """A speculating step on the fixed-shape path, every token a row (`DecodeGraphs.run_verify`)."""
        assert self.fast is not None
        greedy = all(temperature(c.request.params) == 0 for c in chunks)
        logits, streams, argmax = self.fast.run_verify(chunks, greedy)
        verified, spec = self.fast.verified, self.speculation
        best = None if argmax is None else (  # the step's one wait (the drafter's cycle may run behind it)
            spec.after_verify(chunks, verified, argmax).rows()[0] if spec and verified else argmax.tolist())
        window = self.model.config.sliding_window
        sample_rows: list[int] = []
        verify, kept, verify_argmax = {}, {}, {}
        row0 = 0
        for chunk in chunks:
            rid, n = chunk.request.request_id, chunk.num_new_tokens
            if chunk.verify:
                verify[rid] = logits[row0 : row0 + n]
                if best is not None:
                    verify_argmax[rid] = best[row0 : row0 + n]
            elif chunk.samples:
                sample_rows.append(row0 + n - 1)
            if chunk.request.keeps_streams:
                kept[rid] = streams[row0 + n - kept_streams(chunk, window) : row0 + n]
            row0 += n
        sample_logits = logits[to_device(sample_rows, logits.device)]
        return StepResult(sample_logits, None, {}, {}, None, verify, kept, verify_argmax)

    def _prompt_rows(self, chunks: list[ScheduledChunk], rows: SamplingRows) -> StepResult:
        """A step of decodes and short prompt chunks on the fixed-shape path, every token a row
        (`DecodeGraphs.run_verify`): a prompt chunk's rows are computed as a verify chunk's are.
        Each sampling chunk is drawn from its last row's logits: by the captured graph's race where
        every sampling row is plain (no ban, adjustment or cut), else by the sampler, as in a general
        step."""
        assert self.fast is not None
        last_rows = decode_rows.sampling_rows(chunks)
        # Where graphs replay, the race inside saves the sampler's launches and the logits' gather.
        in_graph = self.fast.use_graphs and self.fast.race.draws_at(rows)
        logits, _, drawn = self.fast.run_verify(chunks, draw_at=(rows, last_rows) if in_graph else None)
        index = to_device(last_rows, logits.device)
        self.num_prompt_row_steps += 1
        self.num_prompt_rows_drawn_in_graph += drawn is not None
        return StepResult(logits[index], drawn[index] if drawn is not None else None, {}, {})

    def _run_invariant(self, chunks: list[ScheduledChunk], keep_streams: bool) -> StepResult:
        """Batch-invariant mode (plan.py): the one-token chunks the fixed-shape step takes (decodes,
        and prompt tokens: the chunk budget is one token) in replays of its one padded size; every
        other chunk alone, a verify chunk's positions one at a time, as decodes. A chunk's path
        follows from the chunk alone, never from the rest of the step."""
        fast = self.fast if not keep_streams else None
        taken = [i for i, c in enumerate(chunks) if fast is not None and fast.takes(c)]
        size = fast.max_batch_size if fast is not None else 1
        if not taken and len(chunks) == 1 and len(one_by_one(chunks[0])) == 1:
            return self._forward(chunks, keep_streams)
        results: list[StepResult] = []
        order: list[int] = []  # the chunk index of each sample row of `results`, in their order
        for g in range(0, len(taken), size):
            assert fast is not None
            group = taken[g : g + size]
            part = [chunks[i] for i in group]
            # The graph's own draws are dropped (the step's rows are drawn together afterwards), so
            # its race runs on neutral rows that count nothing.
            logits, _ = fast.run(part, SamplingRows.build([_NEUTRAL] * len(part), [0] * len(part),
                                                          [0] * len(part)))
            sampled = [j for j, c in enumerate(part) if c.samples]
            # A copy: the next replay rewrites the graph's logits.
            results.append(StepResult(logits[to_device(sampled, logits.device)], None, {}, {}))
            order.extend(group[j] for j in sampled)
        alone = set(range(len(chunks))) - set(taken)
        for i, chunk in enumerate(chunks):
            if i in alone:
                results.extend(self._forward([part], keep_streams) for part in one_by_one(chunk))
                order.extend([i] if chunk.samples else [])
        merged = merged_results(results)
        if order != sorted(order):
            rank = sorted(range(len(order)), key=order.__getitem__)
            merged = dataclasses.replace(
                merged, sample_logits=merged.sample_logits[to_device(rank, merged.sample_logits.device)])
        return merged

    def _mixed(self, chunks: list[ScheduledChunk]) -> StepResult | None:
        """A step of decode rows beside other chunks (prefill chunks): the decode rows through the
        fixed-shape step (as a pure decode step of them would run), the rest through the general
        forward, sample rows merged back in chunk order; None when the step is not of that kind.

        The two parts touch disjoint requests' rows, so their order in the step changes nothing;
        the decode step goes first so the device runs it while the host builds the general batch.
        Its race's draw is not used (`rows` None): every row is sampled from the merged logits,
        under the same masks, penalties and counters as in a general step."""
        fast = self.fast
        assert fast is not None
        is_decode = [fast.eligible([c]) for c in chunks]
        num_decodes = sum(is_decode)
        if num_decodes == 0 or num_decodes == len(chunks) or num_decodes > fast.max_batch_size:
            return None
        decodes = [c for c, d in zip(chunks, is_decode, strict=True) if d]
        fast_logits, _ = fast.run(decodes, None)
        fast_logits = fast_logits.float()  # [num_decodes, V]; a graph's static buffer: copied below
        general = self._forward([c for c, d in zip(chunks, is_decode, strict=True) if not d])
        order: list[int] = []  # sample row i -> its row in cat(fast_logits, general.sample_logits)
        next_decode, next_general = 0, num_decodes
        for chunk, decode in zip(chunks, is_decode, strict=True):
            if decode:
                order.append(next_decode)
                next_decode += 1
            elif chunk.samples:
                order.append(next_general)
                next_general += 1
        logits = torch.cat([fast_logits, general.sample_logits.float()])[to_device(order, fast_logits.device)]
        self.num_mixed_steps += 1
        return dataclasses.replace(general, sample_logits=logits, sampled=None)

    def _forward(self, chunks: list[ScheduledChunk], keep_streams: bool = False) -> StepResult:
        batch, spans = self.build_batch(chunks, keep_streams)
        out = self.model(batch, self.pools)
        logits = out.logits
        sample_rows: list[int] = []
        prompt, experts, hidden, verify, streams = {}, {}, {}, {}, {}
        for chunk, (row0, logit0, stream0) in zip(chunks, spans, strict=True):
            request, rid, n = chunk.request, chunk.request.request_id, chunk.num_new_tokens
            if keep_streams and request.keeps_streams and out.streams is not None:
                kept = kept_streams(chunk, self.model.config.sliding_window)
                streams[rid] = out.streams[stream0 : stream0 + kept]
            if chunk.verify:
                verify[rid] = logits[logit0 : logit0 + n]
            elif _wants_rows(chunk):
                if request.rollout.want_prompt_logits:
                    prompt[rid] = logits[logit0 : logit0 + n].cpu()
                if request.rollout.want_prompt_hidden:
                    hidden[rid] = out.hidden[logit0 : logit0 + n].float().cpu()
                if chunk.samples:
                    sample_rows.append(logit0 + n - 1)
            elif chunk.samples:
                sample_rows.append(logit0)
            if request.params.return_routed_experts:
                experts[rid] = out.routed_experts[row0 : row0 + n].to(torch.int16).cpu()
        if sample_rows != list(range(logits.shape[0])):
            logits = logits[to_device(sample_rows, logits.device)]
        return StepResult(logits, None, prompt, experts, hidden, verify, streams)


_NO_ROWS = SamplingRows.build([], [], [])
_NEUTRAL = SamplingParams(temperature=0.0)  # a plain row: the graph's race draws it and counts nothing


def _wants_rows(chunk: ScheduledChunk) -> bool:
    """Whether every token of the chunk needs its logits row (prompt logits or hidden states)."""
    return chunk.request.rollout.wants_prompt_rows


def _replay_rows(chunk: ScheduledChunk, cfg: ModelConfig) -> torch.Tensor:
    """[n, L, k] int64 experts the chunk's tokens must use: the request's replayed routing where it
    covers the positions, -1 (choose freely) past its end or without one."""
    out = torch.full((chunk.num_new_tokens, cfg.num_layers, cfg.num_experts_per_tok), -1, dtype=torch.long)
    given = chunk.request.rollout.replay_experts
    if given is not None:
        stop = min(chunk.stop, given.shape[0])
        if stop > chunk.start:
            out[: stop - chunk.start] = given[chunk.start : stop].long()
    return out


def _penalised(request: Request) -> PenalisedRow | None:
    """What the request's penalty slot is filled from, when its sampling needs one this step."""
    if not needs_slot(request.params, request.num_output_tokens):
        return None
    r = request
    return PenalisedRow(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids)
