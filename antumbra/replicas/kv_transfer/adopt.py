"""Both ends of a KV handoff inside one engine core: export (prefill side), reserve and adopt (decode side).

Sequence, per request:
  1. decode: `reserve(core, request)` matches the prompt in its prefix cache and full-locks the
     first S cached pages (S <= `max_skip_pages`: none whose SWA rows the continuation reads);
     the request is *held* (`scheduler.held`): it owns those locks and no other page.
  2. prefill: the request runs with `max_tokens=1` and `export_kv_from=S`; when its first token is
     sampled, `export_request` copies its rows (payload.py lists them) before it releases its pages
     (which join the prefill side's own cache as usual).
  3. decode: `adopt(core, request, payload)` allocates the pages [S, ceil(N/P)), attaches SWA pages
     to those the continuation reads, writes the rows, records t0 and moves the request from
     held to running: the next step computes position N. When it speculates and the payload
     carries the prompt's last streams (`DRAFT_STREAMS`), its drafter catches up over them and
     drafts at once, so its first step verifies drafts made as after a prefill of its own.
     Or `cancel(core, request)`: the locks are dropped, nothing else was taken.

Invariants: a held request holds full locks on its shared path only (no SWA lock, no own page),
and `check_integrity` counts it like a running one. `adopt` either does all of step 3 or raises
`AdoptionError` with the core exactly as before the call (the request stays held, so the caller
can still cancel it); a payload is validated in full before any page is taken.
"""

from __future__ import annotations

from antumbra.cachestore.pools import KVPools, PoolExhausted

from ..core import EngineCore, TransferCounters
from ..errors import InvalidRequestError
from ..kv_manager import PageNeed
from ..progress import snapshot
from ..request import Request, RequestOutput, RequestStatus
from ..step_io import RunnerOutput, SchedulerOutput
from .payload import DRAFT_STREAMS, KVPayload, LayoutKey, max_skip_pages
from .rows import expected_shapes, read_rows, write_rows


class AdoptionError(RuntimeError):
    """A payload could not be adopted (mismatched layout or prompt, bad tensors, no room); the
    decode side is unchanged."""


def reserve(core: EngineCore, request: Request) -> int:
    """Hold `request` (built by `make_request`, not queued) with its cached prefix locked; -> S."""
    rid = request.request_id
    if rid in core.requests or any(r.request_id == rid for r in core.scheduler.held):
        raise InvalidRequestError(f"request id {rid!r} is already in flight", "request_id")
    kv = core.kv
    limit = max_skip_pages(core.pools.layout, request.num_prompt_tokens)
    shared: list = []
    if kv.tree is not None and limit > 0:
        match = kv.tree.match(request.namespace, request.prompt_token_ids, limit)
        shared = list(match.path[:limit])
        kv.tree.lock(shared, [])
    request.kv.shared_path = shared
    request.kv.swa_locked = {}
    request.kv.vpages = [node.vpage for node in shared]
    core.scheduler.held.append(request)
    return len(shared)


def cancel(core: EngineCore, request: Request) -> None:
    """Drop a held request's locks (a no-op if it is not held)."""
    if request in core.scheduler.held:
        core.scheduler.held.remove(request)
        core.kv.release(request, cache=False)
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"


def _validate(pools: KVPools, request: Request, payload: KVPayload) -> None:
    if payload.layout != LayoutKey.of(pools):
        raise AdoptionError(
            "the payload's pool layout (page size, row formats, compressors) differs from ours"
        )
    if (
        list(payload.prompt_token_ids) != request.prompt_token_ids
        or payload.num_tokens != request.num_prompt_tokens
    ):
        raise AdoptionError("the payload is for another prompt")
    if payload.skip_pages != len(request.kv.shared_path):
        raise AdoptionError(
            f"the payload skips {payload.skip_pages} pages, {len(request.kv.shared_path)} are held"
        )
    want = expected_shapes(pools, payload.num_tokens, payload.skip_pages)
    if set(payload.tensors) - {DRAFT_STREAMS} != set(want):
        raise AdoptionError(f"payload tensors {sorted(payload.tensors)} are not {sorted(want)}")
    for name, (shape, dtype) in want.items():
        got = payload.tensors[name]
        if tuple(got.shape) != shape or got.dtype != dtype:
            raise AdoptionError(
                f"payload tensor {name}: {tuple(got.shape)} {got.dtype}, expected {shape} {dtype}"
            )


def _validate_streams(core: EngineCore, payload: KVPayload) -> None:
    streams = payload.tensors.get(DRAFT_STREAMS)
    if streams is None:
        return
    cfg = core.model_config
    shape = (min(payload.num_tokens, cfg.sliding_window), cfg.hc_mult, cfg.hidden_size)
    dtype = core.model.model.embed_tokens.weight.dtype
    if tuple(streams.shape) != shape or streams.dtype != dtype:
        raise AdoptionError(
            f"payload tensor {DRAFT_STREAMS}: {tuple(streams.shape)} {streams.dtype}, "
            f"expected {shape} {dtype}"
        )


def _draft(core: EngineCore, request: Request, payload: KVPayload) -> None:
    """Drafts for the adopted request's first step from the sender's streams (when both are there)."""
    streams = payload.tensors.get(DRAFT_STREAMS)
    speculation = core.runner.speculation
    if streams is None or request.spec is None or speculation is None:
        return
    device = core.model.model.embed_tokens.weight.device
    request.spec.drafts = speculation.catch_up(request, streams.to(device))


def adopt_or_fail(core: EngineCore, request: Request, payload: KVPayload) -> list[RequestOutput]:
    """`adopt`, or on any failure the request finished with "error" (the core is unchanged then and
    the request's reservation dropped): what the driver runs between steps."""
    try:
        return adopt(core, request, payload)
    except Exception as exc:
        cancel(core, request)
        request.error = f"{type(exc).__name__}: {exc}"
        request.status, request.finish_reason = RequestStatus.FINISHED, "error"
        return [snapshot(request)]


def adopt(core: EngineCore, request: Request, payload: KVPayload) -> list[RequestOutput]:
    """Move a held request to running with the payload's rows; -> its snapshot if t0 finished it."""
    if request not in core.scheduler.held:
        raise AdoptionError(f"request {request.request_id} is not held for adoption")
    pools, kv, sched = core.pools, core.kv, core.scheduler
    try:
        _validate(pools, request, payload)
        _validate_streams(core, payload)
        if pools.hot is not None:
            raise AdoptionError("adopting into HiSparse pools is not supported")
        if len(sched.running) >= sched.cfg.max_num_seqs or not sched.steady_room():
            raise AdoptionError("no room for another running sequence")
        if not 0 <= payload.first_token < core.model_config.vocab_size:
            raise AdoptionError(f"first token {payload.first_token} is outside the vocabulary")
    except AdoptionError:
        core.transfers.failed_adoptions += 1
        raise
    lay = pools.layout
    n, skip = payload.num_tokens, payload.skip_pages
    num_pages = -(-n // lay.page_size)
    swa_first = max(lay.swa_horizon(n) // lay.page_size, skip)
    own = kv._take_pages(PageNeed(num_pages - skip, num_pages - swa_first))
    if own is None:
        core.transfers.failed_adoptions += 1
        raise AdoptionError(f"no room for {num_pages - skip} pages even after evicting the cache")
    block = request.kv.vpages + own
    attached: list[int] = []
    try:
        for logical in range(swa_first, num_pages):
            pools.attach_swa(block[logical])
            attached.append(block[logical])
        write_rows(pools, block, n, skip, payload.tensors)
    except (PoolExhausted, RuntimeError) as exc:
        for vpage in attached:
            pools.detach_swa(vpage)
        pools.free_virtual_pages(own)
        core.transfers.failed_adoptions += 1
        raise AdoptionError(f"writing the payload's rows failed: {exc}") from exc
    request.kv.vpages = block
    request.num_computed_tokens = n
    request.kv.swa_released_pages = swa_first
    request.num_cached_tokens = payload.cached_tokens
    request.record.weights_version = core.weights_version
    core.mark_speculating(request)  # it drafts from its first decode step on
    sched.held.remove(request)
    sched.policy.arrived(request, sched.active_tenants())
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    core.requests[request.request_id] = request
    kv.counters.num_prompt_tokens += request.num_prompt_tokens
    kv.counters.num_cached_tokens += request.num_cached_tokens
    t = core.transfers
    t.adopted_requests += 1
    t.adopted_bytes += payload.nbytes
    t.adopted_pages += num_pages - skip
    t.skipped_pages += skip
    first = RunnerOutput.handed_over(request, payload.first_token, payload.first_logprobs)
    sched.update_from_output(SchedulerOutput(()), first)
    if not request.finished:
        _draft(core, request, payload)
        return []
    core.requests.pop(request.request_id, None)
    return [snapshot(request)]


__all__ = ["AdoptionError", "TransferCounters", "adopt", "adopt_or_fail", "cancel", "read_rows", "reserve"]
