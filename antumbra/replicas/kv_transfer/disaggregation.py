"""What prefill / decode disaggregation asks of an engine: run a prompt and export its KV, adopt it.

`Disaggregation` is one part of an `Engine` (`engine.disaggregation`), built over the engine's core
and driver. The order of calls and what each end holds meanwhile is in adopt.py's docstring. Every
method may be called from any thread; reservations touch the core under the driver's lock (as cache
readers do), adoptions run on the driver thread between steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..awaiting import future_sink, stream_outputs, wait_all, wait_one
from ..request import Request, RequestOutput
from ..sampling_params import SamplingParams
from ..tenancy import DEFAULT_TENANCY, Tenancy
from ..validation import Prompt
from .adopt import adopt_or_fail, cancel, reserve
from .payload import KVPayload

if TYPE_CHECKING:
    from ..core import EngineCore
    from ..driver import Driver, Sink


@dataclass(frozen=True)
class Reservation:
    """A decode-side request held for adoption: the sender must skip `skip_pages` pages."""

    request_id: str
    skip_pages: int
    num_prompt_tokens: int
    request: Request = dataclasses.field(repr=False, compare=False)
    draft_streams: bool = False  # it will speculate here: ask the sender for the drafter's streams


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill side's settings: the request's own, stopping after the first token."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class Disaggregation:
    def __init__(self, core: EngineCore, driver: Driver) -> None:
        self.core = core
        self.driver = driver

    # ------------------------------------------------------------------ prefill side
    def _export_request(
        self, prompt: Prompt, params: SamplingParams, skip_pages: int, request_id: str | None, namespace: str,
        draft_streams: bool,
    ) -> Request:
        return self.core.make_request(
            prompt, prefill_params(params), request_id, namespace=namespace, export_kv_from=skip_pages,
            export_draft_streams=draft_streams,
        )

    def prefill_export(
        self,
        prompt: Prompt,
        params: SamplingParams,
        skip_pages: int = 0,
        *,
        request_id: str | None = None,
        namespace: str = "default",
        draft_streams: bool = False,
    ) -> KVPayload:
        """Compute the prompt and its first token; -> the KV payload (compressed rows from page
        `skip_pages`; with `draft_streams`, the last window's streams a speculating receiver's drafter
        reads, `Reservation.draft_streams`). The request's pages then join this engine's prefix cache."""
        request = self._export_request(prompt, params, skip_pages, request_id, namespace, draft_streams)
        return _finished_payload(wait_all(self.driver, [request])[0], params)

    async def prefill_export_async(
        self,
        prompt: Prompt,
        params: SamplingParams,
        skip_pages: int = 0,
        *,
        request_id: str | None = None,
        namespace: str = "default",
        draft_streams: bool = False,
    ) -> KVPayload:
        """`prefill_export` for an event loop (a cancelled caller aborts the request)."""
        request = self._export_request(prompt, params, skip_pages, request_id, namespace, draft_streams)
        return _finished_payload(await wait_one(self.driver, request), params)

    # ------------------------------------------------------------------ decode side
    def reserve_adoption(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        namespace: str = "default",
        priority: int = 0,
        tenancy: Tenancy = DEFAULT_TENANCY,
    ) -> Reservation:
        """Validate the request and lock the prefix pages this engine holds for it; -> what to ask
        the prefill side for. Raises InvalidRequestError (nothing held)."""
        request = self.core.make_request(prompt, params, request_id, namespace=namespace, priority=priority,
                                         tenancy=tenancy)
        self.driver.health()
        with self.driver.lock:
            skip = reserve(self.core, request)
        return Reservation(request.request_id, skip, request.num_prompt_tokens, request,
                           draft_streams=self.core.speculates(request))

    def cancel_adoption(self, reservation: Reservation) -> None:
        """Drop a reservation whose payload will not come (the transfer failed); idempotent."""
        with self.driver.lock:
            cancel(self.core, reservation.request)

    def adopt_submit(self, reservation: Reservation, payload: KVPayload, sink: Sink) -> str:
        """Queue the adoption; the request's outputs (t0 first) go to `sink`, as for `submit`."""
        request = reservation.request
        self.driver.submit(request, sink, adopt=lambda core: adopt_or_fail(core, request, payload))
        return reservation.request_id

    def adopt_generate(self, reservation: Reservation, payload: KVPayload) -> RequestOutput:
        """Adopt and decode to the end; raises RequestFailedError if the adoption is refused."""
        future: Future = Future()
        self.adopt_submit(reservation, payload, future_sink(future))
        return future.result()

    def adopt_stream(self, reservation: Reservation, payload: KVPayload) -> AsyncIterator[RequestOutput]:
        """Adopt and yield snapshots as `Engine.stream` does (the first carries t0)."""
        return stream_outputs(self.driver, lambda sink: self.adopt_submit(reservation, payload, sink))


def _finished_payload(out: RequestOutput, params: SamplingParams) -> KVPayload:
    payload = out.kv_export
    if payload is None:
        raise RuntimeError(
            f"request {out.request_id} finished ({out.finish_reason}) without exporting its KV"
        )
    final = out.finish_reason if out.finish_reason == "stop" or params.max_tokens <= 1 else None
    return dataclasses.replace(payload, finish_reason=final, text=out.text)


__all__ = ["Disaggregation", "KVPayload", "Reservation", "prefill_params"]
