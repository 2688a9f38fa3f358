"""Admission control: a tenant's request, token and concurrency limits, charged before a generation runs.

Requests/min and tokens/min are GCRA limits in Redis (tokens charged as prompt + max_tokens,
corrected to the real count when the request ends); concurrency is a lease in Redis, renewed while
the request runs. Over a limit: 429 with `Retry-After` and `x-ratelimit-*` headers.

Redis down (documented choice): limits fail open. The request is served unlimited and a warning
is logged: a quota store outage must not take the whole API down, and quotas resume when Redis is
back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from antumbra.platform.ingress.errors import REDIS_ERRORS
from antumbra.platform.ingress.openai_errors import ApiError, invalid
from antumbra.platform.ingress.ratelimit import (
    ConcurrencyLimiter,
    Decision,
    Lease,
    Limit,
    RateLimiter,
    retry_after_header,
)
from antumbra.platform.ingress.tenant_spec import Tenant

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """What an admitted request holds: its token charge and its concurrency lease.

    `settle(used_tokens)` corrects the tokens/min charge to what the request really used and
    releases the lease; it runs once, in a task of its own, so a cancelled handler still settles.
    `on_settle` runs then too, or once `call_ended()` (the replica call's end) is awaited when given:
    a capacity slot must stay taken while Ray Serve still counts the call on its replica.
    """

    limiter: RateLimiter | None
    concurrency: ConcurrencyLimiter | None
    tpm_limit: Limit | None
    lease: Lease | None
    headers: dict[str, str]
    renewer: asyncio.Task | None = None  # keeps the lease alive while the request runs
    on_settle: Callable[[], None] | None = None  # e.g. giving back the model's capacity slot
    _settled: bool = False

    def settle(self, used_tokens: int, tasks: set[asyncio.Task],
               call_ended: Callable[[], Awaitable[None]] | None = None) -> None:
        if self._settled:
            return
        self._settled = True
        if self.renewer is not None:
            self.renewer.cancel()
        _spawn(self._settle(used_tokens), tasks)
        if self.on_settle is None:
            return
        if call_ended is None:
            self.on_settle()
        else:
            _spawn(_then(call_ended(), self.on_settle), tasks)

    async def _settle(self, used_tokens: int) -> None:
        try:
            if self.limiter is not None and self.tpm_limit is not None and used_tokens != self.tpm_limit.cost:
                lim = self.tpm_limit
                await self.limiter.adjust(lim.key, lim.rate_per_min, used_tokens - lim.cost, lim.burst)
        except REDIS_ERRORS as exc:
            log.warning("could not correct the token charge of %s: %r", self.tpm_limit, exc)
        try:
            if self.concurrency is not None and self.lease is not None:
                await self.concurrency.release(self.lease)
        except REDIS_ERRORS as exc:  # the lease lapses by itself
            log.warning("could not release a concurrency lease: %r", exc)


def _spawn(work: Coroutine[Any, Any, None], tasks: set[asyncio.Task]) -> None:
    """Run `work` in a task of its own, kept in `tasks` until it ends."""
    task = asyncio.get_running_loop().create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _then(first: Awaitable[None], then: Callable[[], None]) -> None:
    try:
        await first
    finally:
        then()


async def _renew_lease(limiter: ConcurrencyLimiter, lease: Lease) -> None:
    """Renew a lease every third of its length, so a long request keeps its slot."""
    while True:
        await asyncio.sleep(limiter.lease_s / 3)
        with contextlib.suppress(*REDIS_ERRORS):  # a transient error: the next round tries again
            if await limiter.renew(lease) is None:
                return


def _ratelimit_headers(kind: str, decision: Decision) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(decision.limit),
        f"x-ratelimit-remaining-{kind}": str(max(decision.remaining, 0)),
        f"x-ratelimit-reset-{kind}": f"{decision.reset_after_s:.3f}s",
    }


def _tenant_limits(tenant: Tenant, tokens: int) -> list[tuple[str, Limit]]:
    """The tenant's rate limits as (header kind, limit) charging one request of `tokens` tokens."""
    limits: list[tuple[str, Limit]] = []
    if tenant.rpm is not None:
        limits.append(("requests", Limit(f"{{{tenant.id}}}:rpm", tenant.rpm, 1)))
    if tenant.tpm is not None:
        if tokens > tenant.tpm:
            raise invalid(
                f"this request needs {tokens} tokens (prompt + max_tokens) but the key's limit is "
                f"{tenant.tpm} tokens per minute; lower max_tokens or shorten the prompt",
                "max_tokens",
                code="request_exceeds_token_limit",
            )
        limits.append(("tokens", Limit(f"{{{tenant.id}}}:tpm", tenant.tpm, tokens)))
    return limits


class Admitter:
    """Charges tenants' limits in Redis (`limiter`, `concurrency`) and hands out `Admission`s."""

    def __init__(self, limiter: RateLimiter, concurrency: ConcurrencyLimiter) -> None:
        self.limiter = limiter
        self.concurrency = concurrency

    async def admit(self, tenant: Tenant, tokens: int) -> Admission:
        """Charge the tenant's limits (429 when over); on a Redis error admit without limits."""
        limits = _tenant_limits(tenant, tokens)
        headers: dict[str, str] = {}
        tpm = next((lim for kind, lim in limits if kind == "tokens"), None)
        try:
            decisions = await self.limiter.check_all([lim for _, lim in limits]) if limits else ()
        except REDIS_ERRORS as exc:
            log.warning("rate limiter unavailable (%r); admitting tenant %s without limits", exc, tenant.id)
            return Admission(None, None, None, None, {})
        for (kind, _), decision in zip(limits, decisions, strict=True):
            headers |= _ratelimit_headers(kind, decision)
        if not all(d.allowed for d in decisions):
            wait = retry_after_header(decisions)
            refused = [kind for (kind, _), d in zip(limits, decisions, strict=True) if not d.allowed]
            raise ApiError(
                429,
                f"rate limit reached for {' and '.join(refused)} per minute; retry after {wait} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(wait)},
            )
        admission = Admission(self.limiter, self.concurrency, tpm, None, headers)
        if tenant.max_concurrency is None:
            return admission
        return await self._lease(tenant, limits, admission)

    async def _lease(
        self, tenant: Tenant, limits: list[tuple[str, Limit]], admission: Admission
    ) -> Admission:
        """Take one of the tenant's concurrency slots for `admission` (429 and a refund when none is free)."""
        assert tenant.max_concurrency is not None
        try:
            admission.lease = await self.concurrency.acquire(f"{{{tenant.id}}}:conc", tenant.max_concurrency)
        except REDIS_ERRORS as exc:
            log.warning("concurrency limiter unavailable (%r); admitting tenant %s", exc, tenant.id)
            return admission
        if admission.lease is None:
            await self._refund(limits)
            raise ApiError(
                429,
                f"too many concurrent requests (the limit is {tenant.max_concurrency})",
                type="rate_limit_error",
                code="concurrency_limit_exceeded",
                headers={**admission.headers, "Retry-After": "1"},
            )
        admission.renewer = asyncio.get_running_loop().create_task(
            _renew_lease(self.concurrency, admission.lease)
        )
        return admission

    async def _refund(self, limits: list[tuple[str, Limit]]) -> None:
        """Undo a charge for a request that was refused after all (a full concurrency limit)."""
        for _, lim in limits:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.limiter.refund(lim.key, lim.rate_per_min, lim.cost, lim.burst)
