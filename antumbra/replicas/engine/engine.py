"""The engine: an `EngineCore` stepped by a `Driver`, behind a thread-safe sync and async API.

`generate` waits on a future per request, `stream` on an asyncio queue fed through its loop's
`call_soon_threadsafe` (`awaiting.py`); both submit to the driver, whose module states the threading
contract. Every method here may be called from any thread. Readers of the core's state (`stats`,
`check_integrity`, `cached_block_hashes`, `clear_cache`) take the driver's lock, which it holds
while it steps.

What serving does not need is composed in as parts built over the same core and driver:
`engine.training` (live weight updates, scoring: `training.py`) and `engine.disaggregation`
(prefill / decode KV handoff: `kv_transfer/disaggregation.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from antumbra import env
from antumbra.cachestore.block_hash import BlockEvent
from antumbra.config import CacheConfig, EngineConfig, FastPathConfig, SchedulerConfig, SpeculativeConfig
from antumbra.kernels.cache import use_kernel_cache

from ..awaiting import stream_outputs, wait_all
from ..build import load_model
from ..choices import PREFILL_PARAMS, choice_params
from ..core import EngineCore
from ..driver import Driver, Sink
from ..engine_stats import core_stats
from ..errors import EngineDeadError, FatalEngineError, InvalidRequestError
from ..kv_transfer.disaggregation import Disaggregation
from ..kv_transfer.export import export_request
from ..model.checkpoint_files import detect_layout
from ..model.mtp import MTPBlock
from ..plan import ExpertFormat, resolve_dtype, resolve_plan
from ..plugins import load_plugins
from ..request import RequestOutput, RequestStatus
from ..sampling_params import SamplingParams
from ..speculative.engine_step import draft_block, start_speculation
from ..tenancy import DEFAULT_TENANCY, Tenancy
from ..training import Training
from ..validation import Prompt, as_prompt_list
from ..warmup import WarmupReport, warm_up

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        config: EngineConfig,
        mtp_state_dict: dict[str, Any] | None = None,
        checkpoint_layout: str = "hf",
        gang: Any = None,
        mtp_block: MTPBlock | None = None,
    ) -> None:
        """`gang`: the other ranks of a parallel replica (`parallel/gang.py`); `model` is then
        rank 0's shard, and each forward is broadcast to the gang first. `mtp_block`: the draft
        block speculative decoding runs (`config.speculative`; `load_mtp` reads a checkpoint's).
        With a gang the block is whole on rank 0 and drafts there alone: it reads what every rank
        holds whole (the last layer's streams, the embedding and the LM head), and a verify step is
        a forward like any other, broadcast to the gang."""
        load_plugins()
        self.plan = resolve_plan(config, checkpoint_layout)
        self.gang = gang
        if gang is not None:
            gang.serve(model)
        if self.plan.on_cuda:  # before the core compiles anything (its decode graphs)
            use_kernel_cache(
                Path(config.kernel_cache_dir) if config.kernel_cache_dir else env.kernel_cache_dir()
            )
        # A gang's ranks capture their decode graphs when rank 0 does: hook the graphs first.
        core_plan = dataclasses.replace(self.plan, capture_at_start=False) if gang else self.plan
        self.core = EngineCore(model, tokenizer, config, core_plan, mtp_state_dict, export_kv=export_request)
        start_speculation(self.core, mtp_block)
        if gang is not None:
            self.core.pools.compressed_copies = []  # replayed on the other ranks
            if self.core.runner.fast is not None:
                gang.serve_fixed(self.core.runner.fast, self.core.pools)
                if self.plan.capture_at_start:
                    self.core.runner.fast.capture_all()
        self.warmup: WarmupReport | None = warm_up(self.core) if self.plan.warmup else None
        self.driver = Driver(self.core)
        self._lock = self.driver.lock  # the lock readers take (the publisher takes it too)
        self.training = Training(self.core, self.driver, self.plan, gang)
        self.disaggregation = Disaggregation(self.core, self.driver)

    def __del__(self) -> None:
        driver = getattr(self, "driver", None)
        if driver is not None:
            driver.stop()

    # The core's parts, for inspection (read them under `_lock` while the driver runs).
    model = property(lambda self: self.core.model)
    model_config = property(lambda self: self.core.model_config)
    tokenizer = property(lambda self: self.core.tokenizer)
    config = property(lambda self: self.core.config)
    pools = property(lambda self: self.core.pools)
    kv = property(lambda self: self.core.kv)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    max_model_len = property(lambda self: self.core.max_model_len)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    mtp_state_dict = property(lambda self: self.core.mtp_state_dict)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        *,
        scheduler: SchedulerConfig | None = None,
        cache: CacheConfig | None = None,
        seed: int = 0,
        progress: bool | None = None,
        fast: FastPathConfig | None = None,
        numerics: str = "exact",
        warmup: str = "auto",
        deterministic: bool = False,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        rank_cpus: float = 1.0,
        speculative_tokens: int = 0,
        speculative_max_batch: int | None = None,
        speculative_token_map: str | None = None,
        speculative_gate: str = "fixed",
    ) -> Engine:
        """With `tensor_parallel_size` x `expert_parallel_size` > 1 the replica spans that many
        ranks (`parallel/`): this process is rank 0, the others Ray actors in one placement group
        (each taking `rank_cpus` CPUs, and one GPU on CUDA). `speculative_tokens` > 0 drafts that
        many tokens a step with the checkpoint's MTP block (`SpeculativeConfig`), scoring the token ids
        of the `speculative_token_map` file only when one is given; `speculative_gate` "measured" also
        stops where this engine measures speculation slower (`replicas/speculation_gate.py`)."""
        config = EngineConfig(
            device=device,
            dtype=dtype,
            cache=cache or CacheConfig(),
            scheduler=(scheduler or SchedulerConfig()).with_token_budget(device.split(":")[0]),
            seed=seed,
            fast=fast or FastPathConfig(),
            numerics=numerics,
            warmup=warmup,
            deterministic=deterministic,
            tensor_parallel_size=tensor_parallel_size,
            expert_parallel_size=expert_parallel_size,
            speculative=SpeculativeConfig(tokens=speculative_tokens, token_map=speculative_token_map,
                                          gate=speculative_gate, **(
                {"max_batch": speculative_max_batch} if speculative_max_batch is not None else {})),
        )
        plan = resolve_plan(config)  # a conflicting config fails before any weight is read
        if plan.world_size > 1:
            from ..parallel.launch import load_parallel

            parts = load_parallel(path, config, progress, cpus_per_rank=rank_cpus)
            try:
                block = draft_block(path, config, resolve_dtype(dtype), device)
                return cls(parts.model, parts.tokenizer, config, parts.mtp_state_dict, parts.layout,
                           gang=parts.gang, mtp_block=block)
            except BaseException:
                parts.gang.shutdown()
                raise
        # The plan as the core will make it from the checkpoint's layout: experts it serves packed are
        # read packed, never dense in the model dtype.
        packed = resolve_plan(config, detect_layout(path)).expert_format is ExpertFormat.MXFP4
        loaded = load_model(path, device, resolve_dtype(dtype), progress, packed_experts=packed)
        block = draft_block(path, config, resolve_dtype(dtype), device)
        return cls(loaded.model, loaded.tokenizer, config, loaded.mtp_state_dict, loaded.layout,
                   mtp_block=block)

    # ------------------------------------------------------------------ submitting
    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        sink: Sink,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Validate and queue one request (`kwargs` as `EngineCore.make_request`); its outputs go to
        `sink` (see `driver.py`). Raises InvalidRequestError (nothing queued) or EngineDeadError."""
        request = self.core.make_request(prompt, params, request_id, **kwargs)
        self.driver.submit(request, sink)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point; it releases all it holds. False if unknown or finished.
        Returns once the abort is queued; the driver applies it before its next step."""
        return self.driver.abort(request_id)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued submission and abort is applied and no request is left."""
        return self.driver.wait_idle(timeout_s)

    def health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve (a fatal error, a dead driver, or a
        lost rank of a parallel replica)."""
        self.driver.health()
        if self.gang is not None:
            try:
                self.gang.check()
            except FatalEngineError as exc:
                raise EngineDeadError(f"the engine lost a rank: {exc}") from exc

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the driver (after the step in flight) and, for a parallel replica, its ranks."""
        self.driver.stop()
        thread = getattr(self.driver, "_thread", None)
        if thread is not None:
            thread.join(timeout_s)
        if self.gang is not None:
            self.gang.shutdown()

    # ------------------------------------------------------------------ sync API
    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        namespace: str = "default",
        tenancy: Tenancy = DEFAULT_TENANCY,
        n: int = 1,
    ) -> list[RequestOutput]:
        """Run the prompts to completion together; outputs in prompt order. Every prompt is
        validated before any is queued; a request the engine fails raises RequestFailedError.

        With `n` > 1 each prompt gets `n` choices as the platform makes them (`replicas/choices.py`:
        the prompts computed once, then the choices over their cached pages, choice `i` seeded
        with `choice_seed(seed, i)`): the outputs are prompt-major, the `n` choices of prompt 0,
        then those of prompt 1, and so on."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", "n")
        batch = as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
            if len(params_list) != len(batch):
                raise InvalidRequestError("one SamplingParams per prompt, or one for all", "params")
        if n > 1:
            params_list = [c for sp in params_list for c in choice_params(sp or SamplingParams(), n)]
            prefill = [self.core.make_request(p, PREFILL_PARAMS, namespace=namespace, tenancy=tenancy)
                       for p in batch]
            batch = [p for p in batch for _ in range(n)]
            choices = [self.core.make_request(p, sp, namespace=namespace, tenancy=tenancy)
                       for p, sp in zip(batch, params_list, strict=True)]
            wait_all(self.driver, prefill)  # the prompts' full pages enter the cache for the choices
            return wait_all(self.driver, choices)
        requests = [
            self.core.make_request(p, sp, namespace=namespace, tenancy=tenancy)
            for p, sp in zip(batch, params_list, strict=True)
        ]
        return wait_all(self.driver, requests)

    def prompt_logits(self, prompt: Prompt, namespace: str = "default") -> Any:
        """[S', V] float32 logits of every computed prompt position (S' = S minus cached tokens)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        request = self.core.make_request(prompt, params, namespace=namespace, want_prompt_logits=True)
        out = wait_all(self.driver, [request])[0]
        assert out.prompt_logits is not None
        return out.prompt_logits

    # ------------------------------------------------------------------ async API
    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        namespace: str = "default",
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot whenever the request advances; the last one has `finish_reason` set.

        Cancelling the consumer (a client disconnect) aborts the request in the engine.
        """
        async for item in stream_outputs(
            self.driver,
            lambda sink: self.submit(prompt, params, sink, request_id, priority=priority, namespace=namespace,
                                     tenancy=tenancy)
        ):
            yield item

    # ------------------------------------------------------------------ readers
    def stats(self) -> dict[str, float]:
        """Gauges and counters the platform exports (pool use per pool, cache and scheduler counters)."""
        with self._lock:
            return core_stats(self.core)

    def request_ids(self) -> list[str]:
        """The requests in the engine now (running, waiting or preempted)."""
        with self._lock:
            return list(self.core.requests)

    def check_integrity(self) -> None:
        with self._lock:
            self.core.check_integrity()

    def subscribe(self, callback: Callable[[int, BlockEvent], None]) -> None:
        """Receive every cache event with this engine's sequence number, on the driver thread."""
        with self._lock:
            self.core.subscribe(callback)

    def cached_block_hashes(self) -> list[int]:
        """Block hash of every cached page, parents before children (what a prefix directory lists)."""
        with self._lock:
            tree = self.core.kv.tree
            return [] if tree is None else [n.block_hash for n in tree.nodes_by_depth()]

    def clear_cache(self) -> None:
        with self._lock:
            if self.core.kv.tree is not None:
                self.core.kv.tree.clear()


__all__ = ["Engine", "RequestOutput", "RequestStatus"]
