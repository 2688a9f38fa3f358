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
from typing import Any

import torch

from antumbra.cachestore.block_hash import BlockEvent
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.config import EngineConfig, ModelConfig, SpeculativeConfig

from .build import build_pools, max_model_len, prepare_model
from .decode_graphs import decode_graphs_for
from .decode_rows import graph_batch_sizes
from .errors import FatalEngineError, InvalidRequestError
from .kv_manager import KVManager
from .model.model import DeepseekV4
from .overlap import OverlapStepper, forget
from .penalty_state import PenaltyState
from .plan import ExecutionPlan, SamplerImpl
from .progress import snapshot
from .request import Request, RequestOutput, SpecState
from .request_factory import RequestFactory
from .runner import ModelRunner, Speculation
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .scheduling_policy import make_scheduling_policy
from .step_io import OutputKind, RunnerOutput, SchedulerOutput
from .structured.masks import MaskBuilder
from .text_outputs import TextOutputs
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
        if plan.deterministic:  # every token a one-token chunk, at one launch shape (plan.py)
            sched = dataclasses.replace(sched, max_prefill_chunk_tokens=1)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self.scheduler = Scheduler(sched, self.kv, make_scheduling_policy(plan.scheduling.value),
                                   self.eos_token_ids, self._export, plan.prefill_rows)
        # Penalised requests' token counts on the device (a step samples at most max_num_seqs rows).
        self.penalties = PenaltyState(self.model_config.vocab_size, self.device, self.eos_token_ids,
                                      max_slots=config.scheduler.max_num_seqs)
        self.scheduler.on_finish = self._on_finish
        graphs = decode_graphs_for(self.model, self.pools, self.max_model_len, config, plan, self.penalties)
        self.runner = ModelRunner(self.model, self.pools, self.device, graphs, separate=plan.deterministic,
                                  sampler=Sampler(use_kernel=plan.sampler is SamplerImpl.TRITON),
                                  penalties=self.penalties, overlap=plan.overlap_schedule,
                                  mixed=plan.mixed_steps, prompt_rows=plan.prefill_rows > 0)
        self.requests: dict[str, Request] = {}
        self.factory = RequestFactory(self.model_config, tokenizer, self.max_model_len, config.seed)
        self.num_steps = 0
        self.num_failed_requests = 0
        self.weights_version = "0"  # what `update_weights` last installed
        self.transfers = TransferCounters()  # PD handoffs exported and adopted (kv_transfer/)
        self._export_kv = export_kv
        self.stash: list[RequestOutput] = []  # outputs of a drain that no step has returned yet

    sampler = property(lambda self: self.runner.sampler)

    def enable_speculation(self, speculation: Speculation, config: SpeculativeConfig) -> None:
        """Speculate from now on: requests `speculation.admits` draft and verify (`speculative/`). The
        decode graphs are built again when a verify step's rows outgrow them (an engine built without
        speculation), unless a parallel gang drives them."""
        self.runner.speculation = speculation
        self.scheduler.speculate_with(config if config.tokens > 0 else None)
        self.config = dataclasses.replace(self.config, speculative=config)
        fast = self.runner.fast
        rows = max(graph_batch_sizes(self.config, self.plan.prefill_rows), default=0)
        if fast is not None and fast.before_step is None and rows > fast.max_batch_size:
            self.runner.fast = decode_graphs_for(self.model, self.pools, self.max_model_len, self.config,
                                                 self.plan, self.penalties)
            self.runner.overlap.fast = self.runner.fast

    def mark_speculating(self, request: Request) -> None:
        """Give a request entering the core (queued, or adopted from a prefill engine) its speculation
        state when this core speculates and the request may."""
        if self.speculates(request):
            request.spec = SpecState(catch_up_tokens=self.model_config.sliding_window)

    def speculates(self, request: Request) -> bool:
        """Whether `request` would draft and verify here."""
        return self.runner.speculation is not None and self.runner.speculation.admits(request)

    def _on_finish(self, request: Request) -> None:
        self.penalties.release(request.request_id)
        if self.runner.speculation is not None:
            self.runner.speculation.release(request.request_id)

    @property
    def overlap(self) -> OverlapStepper:
        return self.runner.overlap

    @property
    def masks(self) -> MaskBuilder | None:
        return self.runner.masks

    @property
    def num_generated_tokens(self) -> int:
        return self.scheduler.num_generated_tokens

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
        request.record.weights_version = self.weights_version
        self.mark_speculating(request)
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
        forget(request)
        self.scheduler.finish(request, "abort")
        return snapshot(request)

    def stop_at(self, request_id: str, num_output_tokens: int) -> RequestOutput | None:
        """End a request whose text reached a stop string at its first `num_output_tokens` output
        tokens (`text_outputs.py` finds stop strings off the stepping thread); -> its final
        snapshot, None if unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return None
        forget(request)
        self.scheduler.stop_at(request, num_output_tokens)
        return snapshot(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.overlap.inflight is not None or bool(self.stash)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one step; -> a snapshot of every request that advanced, finished or failed (with
        overlap scheduling, decodes are reported by the step after the one that drew them)."""
        if not self.overlap.can_continue(self.scheduler):
            self.drain()
        early = self._take_stash()
        step = self.scheduler.schedule()
        if not step.chunks:
            return early + (self._resolve() if self.overlap.inflight else self._fail_stalled())
        try:
            row_steps = self.runner.num_prompt_row_steps
            outputs = early + self._run(step)
            self.scheduler.step_finished(as_rows=self.runner.num_prompt_row_steps > row_steps)
            return outputs
        except FatalEngineError:
            raise
        except Exception as exc:
            self.drain()
            return early + self._take_stash() + self._isolate(step.unfinished(), exc)

    def _run(self, step: SchedulerOutput) -> list[RequestOutput]:
        """Launch the step overlapped when it qualifies, else run it, the tokens still in flight
        applied first (the step's plan changed under them)."""
        launched = self.runner.launch(step)
        if launched is not None:
            return self._apply(step, launched)
        self.stash += self._resolve()
        step = step.unfinished()
        outputs = self._apply(step, self.runner.execute(step)) if step.chunks else []
        return self._take_stash() + outputs

    def _take_stash(self) -> list[RequestOutput]:
        outputs, self.stash = self.stash, []
        return outputs

    def _apply(self, step: SchedulerOutput, out: RunnerOutput) -> list[RequestOutput]:
        """The scheduler applies the step's output; -> the snapshots of the requests that advanced
        (the finished ones leave the core)."""
        if out.kind is not OutputKind.RESOLVED:
            self.num_steps += 1
        advanced = self.scheduler.update_from_output(step, out)
        if out.drawn is not None and out.resident is not None:  # counted once the step stands
            self.penalties.record(out.drawn, out.resident)
        if out.kind is OutputKind.LAUNCHED:
            self.overlap.draw()
        outputs = [snapshot(r) for r in advanced]
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs

    def _resolve(self) -> list[RequestOutput]:
        resolved = self.overlap.resolve()
        return self._apply(*resolved) if resolved is not None else []

    def drain(self) -> None:
        """Apply the tokens in flight now; their outputs come with the next step."""
        resolved = self.overlap.drain()
        if resolved is not None:
            self.stash += self._apply(*resolved)

    def _export(self, request: Request) -> Any:
        if self._export_kv is None:
            raise InvalidRequestError("this engine core exports no KV (built without export_kv)",
                                      "export_kv_from")
        return self._export_kv(self.pools, self.transfers, request)

    def _isolate(self, step: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        chunks = step.chunks
        log.error("a step of %d chunk(s) failed; running them one by one", len(chunks), exc_info=exc)
        self._check_device(exc)
        if len(chunks) == 1:
            return [self._fail(chunks[0].request, exc)]
        outputs: list[RequestOutput] = []
        for chunk in chunks:
            single = SchedulerOutput((chunk,))
            try:
                outputs += self._apply(single, self.runner.execute(single))
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
        """Step until the given requests finish (driving by hand); -> their last snapshots in order,
        with their text (made here, as the driver's output side does)."""
        texts = TextOutputs(self.eos_token_ids)
        for rid in request_ids:
            if rid in self.requests:
                texts.register(self.requests[rid])
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending:
            for out in self.with_text(texts, self.step()):
                if out.request_id in pending and out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
            gone = [rid for rid in pending if rid not in self.requests]
            if gone:
                raise KeyError(f"requests {gone} are not in flight")
        return [final[rid] for rid in request_ids]

    def with_text(self, texts: TextOutputs, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs through `texts`; a request a stop string ended is cut and finished now."""
        done, todo = [], list(outputs)
        while todo:
            out = todo.pop(0)
            processed = texts.process(out)
            if processed.output is not None:
                done.append(processed.output)
            if processed.stop_at is not None:
                final = self.stop_at(out.request_id, processed.stop_at)
                todo += [final] if final is not None else []
        return done

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
        if self.pools.hot is not None:
            self.pools.hot.check_integrity()
        self.penalties.check_integrity(live=self.requests)
        if self.runner.speculation is not None:
            self.runner.speculation.check_integrity(set(self.requests))

