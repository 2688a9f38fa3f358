"""Warming an engine before it serves, so no request pays a kernel compilation or a graph capture.

Triton compiles a kernel variant the first time a launch needs it (seconds each on a GPU) and
caches it in memory and on disk (`TRITON_CACHE_DIR`, shared by the replicas of a node; see
`antumbra.env.kernel_cache_dir`). The variants a step needs depend on bucketed step shapes
only (`antumbra/kernels/variants.py` states the rules): the tokens in the step T and the
longest context L, each rounded to a power of two and capped. The warm-up runs the synthetic
steps `variants.warmup_shapes` lists for `max_num_batched_tokens` and `max_model_len` (on CUDA
a cover of every variant key for this model and device), the Triton sampler on their logits once
per row count, and its race over slot-adjusted logits in every variant; the decode graphs are
captured beside it (`DecodeGraphs.capture_all`).

A synthetic step does not compute its context: its request is given pages up to L and
pretends the first L - T tokens are computed, so a 64K-context bucket costs one chunk, not a
64K prefill. Those rows hold whatever the pools hold (zeros at start: the pools are
zero-initialised), and the request is released without entering the prefix cache, so the
warm-up leaves the pools, the cache and the counters as it found them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from antumbra.kernels.sampling.resident import SEARCH_BUCKETS
from antumbra.kernels.variants import VariantModel, compile_watch, warmup_shapes

from .kv_manager import CacheCounters
from .penalty_state import PenalisedRow, PenaltyState
from .plan import ExpertFormat, LinearFormat, NumericsMode
from .request import Request
from .sampler import SamplingRows
from .sampling_params import SamplingParams
from .step_io import ScheduledChunk

if TYPE_CHECKING:
    from .core import EngineCore

log = logging.getLogger(__name__)

WARMUP_NAMESPACE = "__warmup__"  # tenant namespaces are "<model>:<hex>", so this never collides
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
_FILTERED = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, top_k=20, seed=0)


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    num_steps: int
    shapes: tuple[tuple[int, int], ...]  # (tokens, context) of each synthetic step
    kernel_loads: int  # Triton kernel variants compiled or loaded from disk during the warm-up


def warm_up(core: EngineCore) -> WarmupReport:
    """Run every synthetic step the engine's limits call for; -> what it took."""
    started = time.monotonic()
    shapes = _shapes(core)
    sampled_rows: set[int] = set()
    with compile_watch() as watch:
        for tokens, context in shapes:
            _synthetic_step(core, tokens, context, sampled_rows)
        if core.sampler.use_kernel:
            _adjusted_sampling(core)
        if core.device.type == "cuda":
            torch.cuda.synchronize(core.device)
    core.kv.counters = CacheCounters()  # the synthetic requests are not traffic
    report = WarmupReport(time.monotonic() - started, len(shapes), tuple(shapes), watch.count)
    log.info("warm-up: %d steps in %.1f s, %d kernel variants loaded", report.num_steps, report.seconds,
             report.kernel_loads)
    return report


def _shapes(core: EngineCore) -> list[tuple[int, int]]:
    """(tokens, context) of the general steps that reach every kernel variant within the limits;
    on CUDA pruned to a cover of the variant keys for this model and device."""
    sched = core.config.scheduler
    chunk = min(sched.token_budget, sched.max_prefill_chunk_tokens or sched.token_budget)
    longest = core.max_model_len - 1  # the longest prompt: one token must still fit after it
    if core.device.type != "cuda":
        return warmup_shapes(chunk, longest, sched.max_num_seqs)
    plan = core.plan
    model = VariantModel.from_config(core.model_config, fp8_linears=plan.linear_format is LinearFormat.FP8,
                                     mxfp4_experts=plan.expert_format is ExpertFormat.MXFP4,
                                     act_fp8=plan.numerics is NumericsMode.RELEASE)
    num_sms = torch.cuda.get_device_properties(core.device).multi_processor_count
    return warmup_shapes(chunk, longest, sched.max_num_seqs, model=model, num_sms=num_sms)


def _synthetic_step(core: EngineCore, tokens: int, context: int, sampled_rows: set[int]) -> None:
    """One general step of `tokens` tokens whose largest context is `context`: ceil(tokens / context)
    sequences with chunks of `context` tokens (the last one the rest), each ending at position
    context - 1 (so every rate dividing the context closes a window). Its logits are sampled when
    the sampler's kernels run and no earlier step had as many rows (`sampled_rows`): the sampler's
    launches follow the logits' shape [rows, vocab] alone, and its PyTorch reference (on a CPU)
    compiles nothing, so sampling again only spends time."""
    sizes = [context] * (tokens // context) + ([tokens % context] if tokens % context else [])
    requests = [_synthetic_request(core, context, i) for i in range(len(sizes))]
    rows = len(requests)
    try:
        for request, size in zip(requests, sizes, strict=True):
            _pretend_computed(core, request, context - size, context)
        chunks = [ScheduledChunk(r, context - size, size) for r, size in zip(requests, sizes, strict=True)]
        greedy = SamplingRows.build([_GREEDY] * rows, [0] * rows, [0] * rows)
        # The general step even where the decode graphs would take the batch: they were captured
        # already, and mixed batches and HiSparse decodes run the general step's kernels.
        graphs, core.runner.fast = core.runner.fast, None
        try:
            result = core.runner.run(chunks, greedy)
        finally:
            core.runner.fast = graphs
        if core.sampler.use_kernel and rows not in sampled_rows:
            sampled_rows.add(rows)
            core.sampler.sample_tokens(result.sample_logits, greedy)
            cut = SamplingRows.build([_FILTERED] * rows, [0] * rows, [0] * rows)
            core.sampler.sample_tokens(result.sample_logits, cut)
    finally:
        for request in requests:
            core.kv.release(request, cache=False)


def _adjusted_sampling(core: EngineCore) -> None:
    """The race over adjusted logits in each variant it compiles: every search bucket (a logit
    bias over as many tokens as the bucket serves), with and without a top-p row beside it."""
    vocab = core.model_config.vocab_size
    logits = torch.zeros(2, vocab, dtype=torch.float32, device=core.device)
    state = PenaltyState(vocab, core.device, core.eos_token_ids, max_slots=len(SEARCH_BUCKETS))
    for bucket in SEARCH_BUCKETS:
        tokens = range(min(vocab, 1 << (bucket - 1)))  # a slice of 2^(b-1) entries needs b halvings
        biased = SamplingParams(max_tokens=1, seed=0, logit_bias=tuple((t, 1.0) for t in tokens))
        for params in ([biased], [biased, _FILTERED]):
            n = len(params)
            resident = state.rows_for([PenalisedRow(f"bucket-{bucket}", biased, (), ()), None][:n])
            rows = SamplingRows.build(params, [0] * n, [0] * n, resident)
            core.sampler.sample_tokens(logits[:n], rows)


def _synthetic_request(core: EngineCore, context: int, index: int) -> Request:
    # The chunk ends at the prompt's end, so it samples as a prefill's last chunk does.
    prompt = [(7 * i + index) % core.model_config.vocab_size for i in range(context)]
    return core.make_request(prompt, _GREEDY, f"warmup-{index}", namespace=WARMUP_NAMESPACE)


def _pretend_computed(core: EngineCore, request: Request, start: int, stop: int) -> None:
    """Pages (SWA pages over the window and open compressor windows too) for [0, stop), with
    the first `start` tokens taken as computed."""
    core.kv.admit(request)
    page = core.pools.layout.page_size
    request.num_computed_tokens = max(0, core.pools.layout.swa_horizon(start)) // page * page
    if not core.kv.grow(request, stop):
        raise RuntimeError(f"warm-up: the pools cannot hold a {stop}-token context")
    request.num_computed_tokens = start
