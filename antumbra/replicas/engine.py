"""The replica engine: model, pools, scheduler and sampler behind a sync and an async API.

Thread model: all engine state is mutated under `self._lock`. The synchronous
`generate` runs steps on the caller's thread; the async `stream` API starts one
background thread that runs steps while there is work and hands each request's
outputs to the asyncio loop that asked for them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from antumbra.cachestore.block_hash import BlockEvent
from antumbra.cachestore.pools import KVPools, PoolLayout
from antumbra.cachestore.row_format import RowFormat
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.cachestore.sizing import hot_buffers_for, virtual_tokens_for_budget
from antumbra.config import CacheConfig, EngineConfig, FastPathConfig, ModelConfig, SchedulerConfig

from .errors import InvalidRequestError
from .fast_decoder import FastDecoder
from .kv_manager import KVManager
from .model.fp8_linear import pack_fp8_linears
from .model.kv_rows import index_row_format, kv_row_format
from .model.model import DeepseekV4
from .model.numerics import Numerics
from .model.packed_experts import pack_experts
from .request import Request, RequestOutput, RequestStatus
from .runner import Runner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler

Prompt = str | Sequence[int]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_weight_formats(fast: FastPathConfig, device: str, layout: str) -> FastPathConfig:
    """"auto" keeps the checkpoint's formats on CUDA: MXFP4 experts and FP8 linears stay packed."""
    packed = torch.device(device).type == "cuda" and layout == "release"
    if fast.expert_format == "auto":
        fast = replace(fast, expert_format="mxfp4" if packed else "dense")
    if fast.linear_format == "auto":
        fast = replace(fast, linear_format="fp8" if packed else "dense")
    return fast


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class Engine:
    def __init__(
        self,
        model: DeepseekV4,
        tokenizer: Any | None,
        config: EngineConfig,
        mtp_state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.model = model.eval()
        # The model runs in this engine's numerics; engines sharing one model share its mode.
        self.model.set_numerics(Numerics.of(config.numerics))
        kernels = config.fast.general_kernels
        on_cuda = torch.device(config.device).type == "cuda"
        self.model.set_kernels(
            config.numerics == "exact" and (kernels == "on" or (kernels == "auto" and on_cuda))
        )
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.config = config
        self.device = torch.device(config.device)
        self.mtp_state_dict = mtp_state_dict or {}
        sched = config.scheduler
        dtype = resolve_dtype(config.dtype)
        num_swa_pages = self._num_swa_pages(config)
        cache = config.cache
        formats = self._row_formats(config, dtype)
        if cache.device_budget_bytes is not None:
            tokens = virtual_tokens_for_budget(
                self.model_config, cache, num_swa_pages, sched.max_num_seqs, dtype, formats
            )
            cache = replace(cache, num_virtual_tokens=tokens)
        layout = PoolLayout.build(self.model_config, cache, num_swa_pages)
        hot = hot_buffers_for(self.model_config, cache, sched.max_num_seqs, formats[0], self.device)
        self.pools = KVPools(layout, dtype, self.device, hot, *formats)
        capacity = layout.num_virtual_slots
        self.max_model_len = min(sched.max_model_len or capacity, capacity, self.model_config.max_position_embeddings)
        self._event_seq = itertools.count()
        self._subscribers: list[Callable[[int, BlockEvent], None]] = []
        tree = ShadowRadix(self.pools, self._publish) if config.cache.enable_prefix_caching else None
        self.kv = KVManager(self.pools, tree, self.model_config.num_layers, config.cache.enable_swa_replay)
        self.scheduler = Scheduler(sched, self.kv)
        if config.numerics == "exact":  # the packed formats' kernels implement exact numerics only
            if config.fast.expert_format == "mxfp4":
                pack_experts(self.model)
            if config.fast.linear_format == "fp8":
                pack_fp8_linears(self.model)
        self.runner = Runner(self.model, self.pools, self.device, self._fast_decoder(config))
        self.sampler = Sampler()
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self.num_steps = 0
        self.num_generated_tokens = 0

    def _row_formats(self, config: EngineConfig, dtype: torch.dtype) -> tuple[RowFormat, RowFormat]:
        """(KV rows, indexer keys) as the pools store them: see `model/kv_rows.py`."""
        numerics = Numerics.of(config.numerics)
        packed = config.cache.kv_storage == "auto"
        mc = self.model_config
        return (
            kv_row_format(numerics, mc.head_dim, mc.rope_dim, dtype, packed),
            index_row_format(numerics, mc.index_head_dim, dtype, packed),
        )

    def _fast_decoder(self, config: EngineConfig) -> FastDecoder | None:
        """The fixed-shape decode path: on by default on CUDA (with graphs), never with HiSparse."""
        fast = config.fast
        on_cuda = self.device.type == "cuda"
        if fast.decode == "off" or (fast.decode == "auto" and not on_cuda) or self.pools.hot is not None:
            return None
        if config.numerics != "exact":  # the fixed-shape path implements exact numerics only
            return None
        sizes = tuple(b for b in fast.cuda_graph_batch_sizes if b <= config.scheduler.max_num_seqs)
        sizes = sizes or (config.scheduler.max_num_seqs,)
        decoder = FastDecoder(
            self.model, self.pools, self.max_model_len, sizes, use_graphs=on_cuda and fast.cuda_graphs,
            overlap_indexer=fast.overlap_indexer,
        )
        if fast.capture_at_start:
            decoder.capture_all()
        return decoder

    def _num_swa_pages(self, config: EngineConfig) -> int:
        if config.cache.num_swa_pages is not None:
            return config.cache.num_swa_pages
        cfg = self.model_config
        layout = PoolLayout.build(cfg, config.cache, 1)
        chunk_pages = -(-config.scheduler.max_num_batched_tokens // cfg.page_size) + 1
        return config.scheduler.max_num_seqs * layout.steady_swa_pages_per_seq + chunk_pages

    # ------------------------------------------------------------------ loading
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
    ) -> Engine:
        from .model.checkpoint import detect_layout, load_hf_config, load_state_dict

        path = Path(path)
        model_config = ModelConfig.from_hf(load_hf_config(path))
        torch_dtype = resolve_dtype(dtype)
        with torch.device("meta"):
            model = DeepseekV4(model_config)
        expected = {name: (tuple(t.shape), _param_dtype(name, t, torch_dtype)) for name, t in model.state_dict().items()}
        loaded = load_state_dict(path, expected, dtype=torch_dtype, device=device, progress=progress)
        state = {name: t.to(device=device, dtype=expected[name][1]) for name, t in loaded.state_dict.items()}
        model.load_state_dict(state, strict=True, assign=True)
        config = EngineConfig(
            device=device,
            dtype=dtype,
            cache=cache or CacheConfig(),
            scheduler=scheduler or SchedulerConfig(),
            seed=seed,
            fast=_resolve_weight_formats(fast or FastPathConfig(), device, detect_layout(path)),
            numerics=numerics,
        )
        return cls(model, _load_tokenizer(path), config, loaded.mtp_state_dict)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        namespace: str = "default",
        want_prompt_logits: bool = False,
    ) -> str:
        """Validate and queue one request; raises InvalidRequestError and changes nothing on bad input.

        `namespace` scopes prefix reuse: requests share cached pages only within one
        namespace (the platform derives it from the tenant, never from the client).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", "params")
        token_ids = self._prompt_token_ids(prompt)
        self._validate(token_ids, params)
        with self._lock:
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
            request = Request(
                request_id=request_id,
                prompt_token_ids=token_ids,
                params=params,
                generator=_generator(params.seed),
                detokenizer=self._detokenizer(token_ids, params),
                priority=priority,
                want_prompt_logits=want_prompt_logits,
                namespace=namespace,
            )
            request.max_total_tokens = min(len(token_ids) + params.max_tokens, self.max_model_len)
            self._requests[request_id] = request
            self.scheduler.add(request)
        self._wake.set()
        return request_id

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids", "prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence | torch.Tensor):
            if not all(hasattr(t, "__index__") and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("prompt token ids must be integers", "prompt")
            token_ids = [int(t.__index__()) for t in prompt]  # type: ignore[union-attr]
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        return token_ids

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt"
            )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but this model's context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token must fit)",
                "prompt",
            )
        try:
            params.validate_for(vocab)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "stop_token_ids") from exc

    def _detokenizer(self, token_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        from .detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, token_ids, params)

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point and release all it holds. False if unknown or finished."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.finished:
                return False
            self._flush_text(request)
            self.scheduler.finish(request, "abort")
            output = self._snapshot(request)
            self._requests.pop(request_id, None)
        self._dispatch([output])
        return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return a snapshot of every request that advanced or finished."""
        with self._lock:
            chunks = self.scheduler.schedule()
            if not chunks:
                return []
            try:
                result = self.runner.run(chunks)
            except Exception:
                for chunk in chunks:
                    self.scheduler.finish(chunk.request, "error")
                raise
            self.scheduler.after_step(chunks)
            self.num_steps += 1
            outputs = self._sample_and_advance(chunks, result)
            for output in outputs:
                if output.finished:
                    self._requests.pop(output.request_id, None)
        self._dispatch(outputs)
        return outputs

    def _sample_and_advance(self, chunks: list[ScheduledChunk], result) -> list[RequestOutput]:
        for chunk in chunks:
            rid = chunk.request.request_id
            if rid in result.prompt_logits:
                chunk.request.prompt_logits.append(result.prompt_logits[rid])
        sampling = [c.request for c in chunks if c.samples]
        if not sampling:
            return []
        sampled = self.sampler.sample(
            torch.stack([result.sample_logits[r.request_id] for r in sampling]).float(),
            [r.params for r in sampling],
            [r.generator or self._default_generator for r in sampling],
            [len(r.output_token_ids) for r in sampling],
            self.eos_token_ids,
        )
        outputs = []
        for request, token, logprobs in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            self._append_token(request, token, logprobs)
            outputs.append(self._snapshot(request))
        return outputs

    def _append_token(self, request: Request, token: int, logprobs: dict[int, float] | None) -> None:
        params = request.params
        if request.first_token_time_s is None:
            request.first_token_time_s = time.monotonic()
        request.output_token_ids.append(token)
        request.pending_token_ids.append(token)
        self.num_generated_tokens += 1
        if logprobs is not None:
            request.logprobs.append(logprobs)
        reason = None
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif request.detokenizer is not None:
            step = request.detokenizer.append(token)
            request.pending_text += step.new_text
            request.text = request.detokenizer.text
            if step.stopped:
                reason = "stop"
        elif token in params.stop_token_ids:
            reason = "stop"
        if reason is None and (
            len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= request.max_total_tokens
        ):
            reason = "length"
        if reason is not None:
            self._flush_text(request)
            self.scheduler.finish(request, reason)

    @staticmethod
    def _flush_text(request: Request) -> None:
        """Release text held back for a possible stop string or an incomplete character."""
        detok = request.detokenizer
        if detok is not None and not detok.stopped:
            request.pending_text += detok.finish()
            request.text = detok.text

    def _snapshot(self, request: Request) -> RequestOutput:
        prompt_logits = None
        if request.want_prompt_logits and request.finished and request.prompt_logits:
            prompt_logits = torch.cat(request.prompt_logits)[: request.num_prompt_tokens - request.num_cached_tokens]
        output = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,  # never mutated; a copy per step is O(context)
            token_ids=list(request.output_token_ids),
            text=request.text,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            cached_tokens=request.num_cached_tokens,
            finish_reason=request.finish_reason,
            new_token_ids=request.pending_token_ids,
            new_text=request.pending_text,
            prompt_logits=prompt_logits,
        )
        request.pending_token_ids = []
        request.pending_text = ""
        return output

    # ------------------------------------------------------------------ sync API
    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        namespace: str = "default",
    ) -> list[RequestOutput]:
        """Run the prompts to completion together; outputs in prompt order."""
        batch: list[Prompt] = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(batch)
        else:
            params_list = list(params)
            if len(params_list) != len(batch):
                raise InvalidRequestError("one SamplingParams per prompt, or one for all", "params")
        for prompt, p in zip(batch, params_list, strict=True):
            self._validate(self._prompt_token_ids(prompt), p)
        ids = [
            self.add_request(prompt, p, namespace=namespace) for prompt, p in zip(batch, params_list, strict=True)
        ]
        return self._run_to_completion(ids)

    def prompt_logits(self, prompt: Prompt, namespace: str = "default") -> torch.Tensor:
        """[S', V] float32 logits of every computed prompt position (S' = S minus cached tokens)."""
        rid = self.add_request(
            prompt, SamplingParams(max_tokens=1, temperature=0.0), want_prompt_logits=True, namespace=namespace
        )
        out = self._run_to_completion([rid])[0]
        assert out.prompt_logits is not None
        return out.prompt_logits

    def _run_to_completion(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        try:
            while pending:
                outputs = self.step()
                if not outputs and not self.scheduler.running and self.scheduler.waiting:
                    raise RuntimeError("requests cannot be admitted: the pools are too small for them")
                for out in outputs:
                    if out.request_id in pending and out.finished:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        except BaseException:
            for rid in pending:
                self.abort(rid)
            raise
        return [final[rid] for rid in request_ids]

    # ------------------------------------------------------------------ async API
    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        namespace: str = "default",
    ) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot whenever the request advances; the last one has `finish_reason` set.

        Cancelling the consumer (a client disconnect) aborts the request in the engine.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            rid = self.add_request(prompt, params, request_id, priority=priority, namespace=namespace)
            self._streams[rid] = (loop, queue)
        self._ensure_loop_thread()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)

    def _ensure_loop_thread(self) -> None:
        with self._lock:
            if self._loop_thread is None or not self._loop_thread.is_alive():
                self._loop_thread = threading.Thread(target=self._background_loop, name="engine-loop", daemon=True)
                self._loop_thread.start()
        self._wake.set()

    def _background_loop(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            while self.has_unfinished():
                try:
                    self.step()
                except Exception as exc:  # fail the affected streams, keep serving the rest
                    self._fail_streams(exc)

    def _fail_streams(self, exc: Exception) -> None:
        with self._lock:
            streams = dict(self._streams)
            finished = [rid for rid in streams if rid not in self._requests or self._requests[rid].finished]
        for rid in finished:
            loop, queue = streams[rid]
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine step failed: {exc}"))

    # ------------------------------------------------------------------ cache events
    def subscribe(self, callback: Callable[[int, BlockEvent], None]) -> None:
        """Receive every cache event with this engine's sequence number (0, 1, 2, ...)."""
        self._subscribers.append(callback)

    def _publish(self, event: BlockEvent) -> None:
        seq = next(self._event_seq)
        for callback in self._subscribers:
            callback(seq, event)

    def cached_block_hashes(self) -> list[int]:
        """Block hash of every cached page, parents before children (what a prefix directory lists)."""
        with self._lock:
            if self.kv.tree is None:
                return []
            return [n.block_hash for n in sorted(self.kv.tree._nodes(), key=lambda n: n.depth)]

    def clear_cache(self) -> None:
        with self._lock:
            if self.kv.tree is not None:
                self.kv.tree.clear()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, float]:
        """Gauges and counters the platform exports (pool use per pool, cache and scheduler counters)."""
        with self._lock:
            usage = self.pools.usage()
            counters = self.kv.counters
            tree = self.kv.tree.stats() if self.kv.tree is not None else {}
            prompt = max(counters.num_prompt_tokens, 1)
            return {
                "num_running": float(len(self.scheduler.running)),
                "num_waiting": float(len(self.scheduler.waiting)),
                "running_tokens": float(sum(r.num_tokens for r in self.scheduler.running)),
                "pool_use_virtual": usage["virtual"],
                "pool_use_swa": usage["swa"],
                "num_steps": float(self.num_steps),
                "num_generated_tokens": float(self.num_generated_tokens),
                "prompt_tokens": float(counters.num_prompt_tokens),
                "cached_tokens": float(counters.num_cached_tokens),
                "hit_rate": counters.num_cached_tokens / prompt,
                "computed_prompt_tokens": float(counters.num_computed_prompt_tokens),
                "replays": float(counters.num_replays),
                "replayed_tokens": float(counters.num_replayed_tokens),
                "preemptions": float(counters.num_preemptions),
                "cache_nodes": float(tree.get("nodes", 0)),
                "tombstones": float(tree.get("tombstones", 0)),
                "full_evictions": float(tree.get("full_evictions", 0)),
                "swa_evictions": float(tree.get("swa_evictions", 0)),
                "host_tier_hits": float(self.pools.hot.counters.hits if self.pools.hot else 0),
                "host_tier_misses": float(self.pools.hot.counters.misses if self.pools.hot else 0),
                "pool_device_bytes": float(self.pools.device_bytes()),
            }

    def check_integrity(self) -> None:
        with self._lock:
            self.scheduler.check_integrity()
            if self.pools.hot is not None:
                self.pools.hot.check_integrity()


def _param_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Parameters the reference keeps in float32 whatever the model dtype (mixing, sinks, biases, norms)."""
    if not tensor.is_floating_point():
        return tensor.dtype
    keep_fp32 = ("_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias", "norm.weight")
    return torch.float32 if any(key in name for key in keep_fp32) else dtype


def _as_prompt_list(prompts: Sequence[Prompt] | Prompt) -> list[Prompt]:
    """One prompt (a string or a list of ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists():
        return None
    from .tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


__all__ = ["Engine", "RequestOutput", "RequestStatus", "replace"]
