"""The engine core: requests in, one step at a time, outputs out. It owns no thread.

Threading contract: an `EngineCore` is not thread-safe. Once an `Engine` (engine.py) drives it,
only the driver's thread calls it, under the driver's lock; before that, whoever built it may
step it by hand (tests and benchmarks do).

Failure contract, for one step:
* A step that raises fails only the requests it concerns. The step's chunks are run again one
  by one (rewriting a chunk's KV rows is idempotent), so a request that breaks the step fails
  alone and the others advance. A failed request gets finish_reason "error" with its `error`,
  releases every page it holds, and nothing of its KV enters the prefix cache.
* A failure the engine cannot continue from (the device no longer answers, the pools lose
  integrity) raises `FatalEngineError` from `step`.
* A waiting request that cannot be admitted while nothing runs (every cached page is then
  evictable) can never be: it fails with a message saying why, instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from antumbra.cachestore.block_hash import BlockEvent
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.config import EngineConfig, ModelConfig

from .build import build_pools, max_model_len, prepare_model
from .decode_graphs import decode_graphs_for
from .errors import FatalEngineError, InvalidRequestError
from .kv_manager import KVManager
from .model.model import DeepseekV4
from .overlap import OverlapStepper
from .penalty_state import PenalisedRow, PenaltyState, needs_slot
from .plan import ExecutionPlan, SamplerImpl
from .progress import append_token, flush_text, snapshot
from .request import Request, RequestOutput
from .request_factory import RequestFactory
from .runner import Runner, StepResult
from .sampler import Sampler, SamplingRows, gather_logprobs
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .scheduling_policy import make_scheduling_policy
from .structured.masks import MaskBuilder, PendingMask
from .validation import Prompt

log = logging.getLogger(__name__)


@dataclass
class TransferCounters:
    """Prefill / decode KV handoffs exported and adopted (`kv_transfer/`)."""

    exported_requests: int = 0
    exported_bytes: int = 0
    exported_pages: int = 0
    adopted_requests: int = 0
    adopted_bytes: int = 0
    adopted_pages: int = 0  # pages whose rows arrived
    skipped_pages: int = 0  # prefix pages the decode side had cached (their rows were not sent)
    failed_adoptions: int = 0


# (pools, counters, finished request) -> its exported KV payload
KVExporter = Callable[[Any, TransferCounters, Request], Any]


class _Executed(NamedTuple):
    result: StepResult
    sampling: list[Request]  # requests that sampled, in row order
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    drawn: torch.Tensor | None = None  # [S] int64 the same tokens on the device, still to be counted
    rows: SamplingRows | None = None


class EngineCore:
    def __init__(
        self,
        model: DeepseekV4,
        tokenizer: Any | None,
        config: EngineConfig,
        plan: ExecutionPlan,
        mtp_state_dict: dict[str, torch.Tensor] | None = None,
        export_kv: KVExporter | None = None,
    ) -> None:
        """`export_kv`: reads a finished request's rows out of the pools when it was run with
        `export_kv_from` (prefill / decode disaggregation, `kv_transfer/export.py`)."""
        self.config = config
        self.plan = plan
        self.model = prepare_model(model, plan)
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.device = plan.device
        self.mtp_state_dict = mtp_state_dict or {}
        self.pools = build_pools(self.model_config, config, plan)
        self.max_model_len = max_model_len(self.model_config, config, self.pools)
        self._event_seq = 0
        self._subscribers: list[Callable[[int, BlockEvent], None]] = []
        tree = ShadowRadix(self.pools, self._publish) if config.cache.enable_prefix_caching else None
        self.kv = KVManager(self.pools, tree, self.model_config.num_layers, config.cache.enable_swa_replay)
        sched = config.scheduler
        if plan.deterministic:  # every token in a one-token chunk, each its own forward (plan.py)
            sched = dataclasses.replace(sched, max_prefill_chunk_tokens=1)
        self.scheduler = Scheduler(sched, self.kv, make_scheduling_policy(plan.scheduling.value))
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        # Penalised requests' token counts on the device (a step samples at most max_num_seqs rows).
        self.penalties = PenaltyState(self.model_config.vocab_size, self.device, self.eos_token_ids,
                                      max_slots=config.scheduler.max_num_seqs)
        self.scheduler.on_finish = lambda request: self.penalties.release(request.request_id)
        graphs = decode_graphs_for(self.model, self.pools, self.max_model_len, config, plan, self.penalties)
        self.runner = Runner(self.model, self.pools, self.device, graphs, separate=plan.deterministic)
        self.sampler = Sampler(use_kernel=plan.sampler is SamplerImpl.TRITON)
        self.requests: dict[str, Request] = {}
        self.factory = RequestFactory(self.model_config, tokenizer, self.max_model_len, config.seed)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_failed_requests = 0
        self.weights_version = "0"  # what `update_weights` last installed
        self.transfers = TransferCounters()  # PD handoffs exported and adopted (kv_transfer/)
        self._export_kv = export_kv
        self.overlap = OverlapStepper(self, plan.overlap_schedule)
        self.masks: MaskBuilder | None = None  # structured output's mask worker, made on first use

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> Request:
        """A validated request, not yet queued (`RequestFactory.build`); raises InvalidRequestError
        and changes nothing. The one core method any thread may call."""
        return self.factory.build(prompt, params, request_id, **kwargs)

    def add(self, request: Request) -> str:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight", "request_id")
        request.weights_version = self.weights_version
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    **kwargs: Any) -> str:
        """`make_request` then `add`; -> the request id."""
        return self.add(self.make_request(prompt, params, request_id, **kwargs))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any point and release all it holds; None if unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return None
        self.overlap.forget(request)
        flush_text(request)
        self.scheduler.finish(request, "abort")
        return snapshot(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.overlap.busy

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one step; -> a snapshot of every request that advanced, finished or failed (with
        overlap scheduling, decodes are reported by the step after the one that drew them)."""
        overlap = self.overlap
        if not overlap.can_continue():
            overlap.drain()
        early = overlap.take_stash()
        chunks = self.scheduler.schedule()
        if not chunks:
            return early + (overlap.resolve() if overlap.busy else self._fail_stalled())
        try:
            if overlap.enabled:
                rows = self._rows([c.request for c in chunks if c.samples])
                if overlap.eligible(chunks, rows):
                    return early + overlap.launch(chunks, rows)
                if overlap.inflight is not None:  # the step's plan changed under the tokens in flight
                    early += overlap.resolve()
                    chunks = [c for c in chunks if not c.request.finished]
                    if not chunks:
                        return early
            return early + self._complete(chunks, self._execute(chunks))
        except FatalEngineError:
            raise
        except Exception as exc:
            overlap.drain()
            return early + overlap.take_stash() + self._isolate(chunks, exc)

    def _rows(self, sampling: list[Request]) -> SamplingRows:
        resident = self.penalties.rows_for([_penalised(r) for r in sampling])
        return SamplingRows.build(
            [r.params for r in sampling], [r.seed for r in sampling], [r.num_output_tokens for r in sampling],
            resident,
        )

    def _execute(self, chunks: list[ScheduledChunk]) -> _Executed:
        """Run the model and sample; changes no request (so a failed step can be re-run)."""
        sampling = [c.request for c in chunks if c.samples]
        rows = self._rows(sampling)
        masks = self.start_masks(sampling)  # filled on a worker thread while the forward runs
        result = self.runner.run(chunks, rows)
        if not sampling:
            return _Executed(result, [], [], [])
        tokens, drawn = result.sampled, None  # a decode graph's draws are counted in the graph
        allowed = masks.result(result.sample_logits.device) if masks is not None else None
        if tokens is None or allowed is not None:
            tokens = drawn = self.sampler.sample_tokens(result.sample_logits, rows, allowed)
        token_ids = tokens.tolist()
        return _Executed(
            result, sampling, token_ids, gather_logprobs(result.sample_logits, rows.params, token_ids),
            drawn, rows,
        )

    def start_masks(self, sampling: list[Request]) -> PendingMask | None:
        """The allowed-token masks of the rows whose request has a grammar (a finished request's
        row is left free: its draw is dropped); None when no row has one."""
        if all(r.grammar is None for r in sampling):
            return None
        if self.masks is None:
            self.masks = MaskBuilder(self.model_config.vocab_size, self.device)
        return self.masks.start([None if r.finished else r.grammar for r in sampling])

    def _complete(self, chunks: list[ScheduledChunk], done: _Executed) -> list[RequestOutput]:
        if done.rows is not None and done.drawn is not None:  # counted once the step stands
            self.penalties.record(done.drawn, done.rows.resident)
        self.scheduler.after_step(chunks)
        self.num_steps += 1
        for rid, logits in done.result.prompt_logits.items():
            self.requests[rid].prompt_logits.append(logits)
        for rid, hidden in (done.result.prompt_hidden or {}).items():
            self.requests[rid].prompt_hidden.append(hidden)
        for rid, experts in done.result.routed_experts.items():
            self.requests[rid].routed_experts.append(experts)
        for request, token, logprobs in zip(done.sampling, done.token_ids, done.logprobs, strict=True):
            self.num_generated_tokens += 1
            reason = append_token(request, token, logprobs, self.eos_token_ids)
            if reason is not None:
                if request.export_kv_from is not None:  # PD: its rows leave before its pages do
                    request.kv_export = self._export(request)
                self.scheduler.finish(request, reason)
        outputs = [snapshot(r) for r in done.sampling]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _export(self, request: Request) -> Any:
        if self._export_kv is None:
            raise InvalidRequestError("this engine core exports no KV (built without export_kv)",
                                      "export_kv_from")
        return self._export_kv(self.pools, self.transfers, request)

    def _isolate(self, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
        log.error("a step of %d chunk(s) failed; running them one by one", len(chunks), exc_info=exc)
        self._check_device(exc)
        if len(chunks) == 1:
            return [self._fail(chunks[0].request, exc)]
        outputs: list[RequestOutput] = []
        for chunk in chunks:
            try:
                outputs += self._complete([chunk], self._execute([chunk]))
            except FatalEngineError:
                raise
            except Exception as alone:
                log.error("request %s failed its step", chunk.request.request_id, exc_info=alone)
                outputs.append(self._fail(chunk.request, alone))
        return outputs

    def _check_device(self, exc: Exception) -> None:
        """Raise FatalEngineError when the failure left the device unusable (CUDA errors are sticky)."""
        accelerator_error = getattr(torch, "AcceleratorError", None)
        if accelerator_error is not None and isinstance(exc, accelerator_error):
            raise FatalEngineError(f"the device failed: {exc}") from exc
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception as lost:
                raise FatalEngineError(f"the device failed: {lost}") from exc

    def _fail(self, request: Request, exc: BaseException) -> RequestOutput:
        request.error = f"{type(exc).__name__}: {exc}"
        flush_text(request)
        self.scheduler.finish(request, "error", cache=False)  # its KV may be garbage: never cached
        self.requests.pop(request.request_id, None)
        self.num_failed_requests += 1
        return snapshot(request)

    def _fail_stalled(self) -> list[RequestOutput]:
        """Nothing could be scheduled. With nothing running the head of the queue can never be
        admitted; with requests running and none able to grow, they cannot progress either."""
        if self.scheduler.running:
            stuck = list(self.scheduler.running)
            why = "the KV pools cannot hold the running requests' next tokens"
        elif self.scheduler.waiting:
            head = self.scheduler.head_of_queue()
            assert head is not None
            stuck = [head]
            why = (
                f"the KV pools cannot hold this request ({stuck[0].num_tokens} tokens) even with the cache "
                f"empty ({self.pools.layout.num_virtual_slots} token slots)"
            )
        else:
            return []
        log.warning("failing %d request(s): %s", len(stuck), why)
        return [self._fail(r, RuntimeError(why)) for r in stuck]

    def run_until_finished(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Step until the given requests finish (driving by hand); -> their last snapshots in order."""
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending:
            for out in self.step():
                if out.request_id in pending and out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
            gone = [rid for rid in pending if rid not in self.requests]
            if gone:
                raise KeyError(f"requests {gone} are not in flight")
        return [final[rid] for rid in request_ids]

    # ------------------------------------------------------------------ cache events
    def subscribe(self, callback: Callable[[int, BlockEvent], None]) -> None:
        """Receive every cache event with this engine's sequence number (0, 1, 2, ...)."""
        self._subscribers.append(callback)

    def _publish(self, event: BlockEvent) -> None:
        seq, self._event_seq = self._event_seq, self._event_seq + 1
        for callback in self._subscribers:
            callback(seq, event)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.penalties.check_integrity(live=self.requests)
        if self.pools.hot is not None:
            self.pools.hot.check_integrity()


def _penalised(request: Request) -> PenalisedRow | None:
    """What the request's penalty slot is filled from, when its sampling needs one this step."""
    if not needs_slot(request.params, request.num_output_tokens):
        return None
    r = request
    return PenalisedRow(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids)
