"""Prefill and decode replicas of a disaggregated model (`disaggregation` in its model spec).

The ingress is unchanged: it streams `generate` from the model's deployment, which for a
disaggregated model holds the *decode* replicas; its cache-affinity router picks one by load and
by the prefix it holds (the Redis directory lists every replica's cached pages, of both kinds).
One request on a decode replica (`DecodeServer._outputs`):

  1. reserve: its engine locks the prefix pages it caches for the prompt (S of them, none whose
     SWA rows the continuation reads) and holds the request (replicas/kv_transfer/adopt.py);
  2. prefill: it calls the prefill deployment's `prefill(request, S)` through a handle whose
     router (cache affinity over the prefill replicas) picks one; that replica computes the prompt
     and the first token, and sends the request's KV minus the S pages through the transport
     (Ray's object store), answering with the ticket;
  3. adopt: it receives the payload, adopts it and streams the rest (t0 first) as a plain replica.

Failures: a prefill replica that dies (or whose transfer is lost) before the handoff is retried,
Serve routing the retry to a live replica, until `prefill_retry_s` is spent; then the request ends
with a 503 error item (the ingress may retry another decode replica). Whatever fails, the decode
engine's reservation is cancelled, so it holds nothing. A decode replica that dies mid-stream ends
the ingress's stream with an error event (the ingress's replica_stream handles a dead replica).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from antumbra.platform.messages import GenerateRequest
from antumbra.platform.replica.model_server import ModelServer
from antumbra.replicas.errors import EngineDeadError, RequestFailedError

if TYPE_CHECKING:
    from antumbra.replicas.kv_transfer.transport import TransferTicket
    from antumbra.replicas.request import RequestOutput

log = logging.getLogger(__name__)


class PrefillServer(ModelServer):
    """A replica that computes prompts and first tokens and hands their KV over.

    A prompt of at least `cp_threshold_tokens` tokens whose first token is greedy (and cannot end
    it by a stop string) is computed over `cp_ranks` context-parallel ranks, threads of this
    replica joined by gloo, each with pools of its own (replicas/context_parallel/); the others, and
    every prompt when `cp_ranks` is 1, by the engine.
    """

    def __init__(
        self,
        *args: Any,
        cp_ranks: int = 1,
        cp_threshold_tokens: int = 8192,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        from antumbra.replicas.kv_transfer.transport import RayObjectTransport

        self.transport = RayObjectTransport()
        self.cp_ranks, self.cp_threshold_tokens = cp_ranks, cp_threshold_tokens
        self.num_cp_prefills = 0

    def _context_parallel(self, request: GenerateRequest) -> bool:
        """Long, greedy, and t0 can end it only by EOS; its logprobs at most the chosen token's (under
        greedy, the top-1 alternative is the chosen token itself)."""
        p = request.params
        return (
            self.cp_ranks > 1
            and len(request.token_ids) >= self.cp_threshold_tokens
            and p.temperature == 0
            and p.logprobs in (None, 0, 1)
            and not p.stop
            and not p.stop_token_ids
            and p.min_tokens == 0
            and p.max_tokens > 1
        )

    def _cp_payload(self, request: GenerateRequest, skip_pages: int, draft_streams: bool) -> Any:
        from antumbra.replicas.context_parallel.handoff import cp_prefill_payload, prompt_pools

        engine, n = self.engine, len(request.token_ids)
        payload = cp_prefill_payload(
            engine.model,
            lambda: prompt_pools(engine.model_config, engine.config, engine.plan, n),
            list(request.token_ids),
            self.cp_ranks,
            request.request_id,
            skip_pages=min(skip_pages, n // engine.model_config.page_size),
            over_gloo=True,
            draft_streams=draft_streams,
        )
        self.num_cp_prefills += 1
        if payload.first_token in engine.eos_token_ids and not request.params.ignore_eos:
            payload = dataclasses.replace(payload, finish_reason="stop")
        return payload

    async def prefill(self, request: GenerateRequest, skip_pages: int, draft_streams: bool = False
                      ) -> TransferTicket:
        """Compute `request`'s prompt and first token; -> the ticket of its KV (pages from `skip_pages`;
        `draft_streams`: with the streams a speculating decode replica's drafter reads)."""
        self._in_flight += 1
        try:
            if self._context_parallel(request):
                payload = await asyncio.to_thread(self._cp_payload, request, skip_pages, draft_streams)
            else:
                payload = await self.engine.disaggregation.prefill_export_async(
                    request.token_ids,
                    request.params,
                    skip_pages,
                    request_id=request.request_id,
                    namespace=request.namespace,
                    draft_streams=draft_streams,
                )
            return await asyncio.to_thread(self.transport.send, payload)
        finally:
            self._in_flight -= 1

    async def engine_stats(self) -> dict[str, float]:
        stats = await super().engine_stats()
        return {**stats, "cp_prefills": float(self.num_cp_prefills)}

class PrefillUnavailable(RuntimeError):
    """No prefill replica computed the prompt within the retry budget."""


class DecodeServer(ModelServer):
    """A replica that adopts KV computed by the prefill deployment (`prefill`, a handle) and decodes."""

    def __init__(self, *args: Any, prefill: Any, prefill_retry_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from antumbra.replicas.kv_transfer.transport import RayObjectTransport

        self.prefill = prefill
        self.prefill_retry_s = prefill_retry_s
        self.transport = RayObjectTransport()
        self.num_prefill_retries = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        try:
            async for item in super().generate(request):
                yield item
        except PrefillUnavailable as exc:
            from antumbra.platform.messages import REPLICA_UNAVAILABLE, error_item

            yield error_item(503, str(exc), None, "server_error", REPLICA_UNAVAILABLE)

    async def _outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        params = request.params
        if params.seed is None:  # both ends sample with the same noise key
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        pd = self.engine.disaggregation
        # Under the driver's lock (at most one step): off the replica's event loop. A caller gone
        # meanwhile still gets its reservation dropped once it is made.
        reserving = asyncio.ensure_future(
            asyncio.to_thread(
                functools.partial(
                    pd.reserve_adoption,
                    request.token_ids,
                    params,
                    request.request_id,
                    namespace=request.namespace,
                    priority=request.priority,
                    tenancy=request.tenancy,
                )
            )
        )
        try:
            reservation = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(lambda t: _drop(pd, t))
            raise
        try:
            payload = await self._prefill(dataclasses.replace(request, params=params), reservation.skip_pages,
                                          reservation.draft_streams)
        except BaseException:
            pd.cancel_adoption(reservation)
            raise
        if payload.finish_reason is not None:  # t0 ended it: nothing to decode
            pd.cancel_adoption(reservation)
            yield _first_only(request, payload)
            return
        async for out in pd.adopt_stream(reservation, payload):
            yield out

    async def _prefill(self, request: GenerateRequest, skip_pages: int, draft_streams: bool) -> Any:
        """The payload, from whichever prefill replica answers; retries dead ones until the budget ends."""
        import ray

        from antumbra.replicas.kv_transfer.transport import TransferFailed

        deadline = time.monotonic() + self.prefill_retry_s
        delay = 0.5
        while True:
            try:
                ticket = await self.prefill.prefill.remote(request, skip_pages, draft_streams)
                return await asyncio.to_thread(self.transport.receive, ticket)
            except (ray.exceptions.RayActorError, TransferFailed, EngineDeadError) as exc:
                failure: Exception = exc
            except RequestFailedError:
                raise
            except Exception as exc:  # Serve wraps a replica's death in its own errors too
                if "died" not in str(exc).lower() and "unavailable" not in str(exc).lower():
                    raise
                failure = exc
            self.num_prefill_retries += 1
            if time.monotonic() + delay > deadline:
                raise PrefillUnavailable(f"no prefill replica answered for {request.request_id}: {failure}")
            log.warning("prefill of %s failed (%s); retrying", request.request_id, failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)

    async def engine_stats(self) -> dict[str, float]:
        stats = await super().engine_stats()
        return {**stats, "prefill_retries": float(self.num_prefill_retries)}


def _drop(pd: Any, reserving: asyncio.Future) -> None:
    if not reserving.cancelled() and reserving.exception() is None:
        pd.cancel_adoption(reserving.result())


def _first_only(request: GenerateRequest, payload: Any) -> RequestOutput:
    from antumbra.replicas.request import RequestOutput

    logprobs = [payload.first_logprobs] if payload.first_logprobs is not None else None
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=list(request.token_ids),
        token_ids=[payload.first_token],
        text=payload.text,
        logprobs=logprobs if request.params.logprobs is not None else None,
        cached_tokens=payload.cached_tokens,
        finish_reason=payload.finish_reason,
        new_token_ids=[payload.first_token],
        new_text=payload.text,
    )
