"""Who is calling: an API key to its tenant, and the admin key.

Redis down (documented choice): authentication asks Redis on every request (so a rotated or
deleted key stops working at once), and keeps the last answer per key. While Redis fails, a key
confirmed within `stale_s` seconds before Redis was last seen answering is still accepted, for as
long as the outage lasts (a long outage locks no known tenant out); any other key gets 503 (fail
closed). So a key revoked through another ingress keeps working here only if this ingress had
confirmed it less than `stale_s` before the outage.
"""

from __future__ import annotations

import collections
import hmac
import logging

from fastapi import Request

from antumbra.platform.ingress.errors import REDIS_ERRORS
from antumbra.platform.ingress.openai_errors import ApiError, unavailable
from antumbra.platform.ingress.redis_health import RedisHealth
from antumbra.platform.ingress.tenant_spec import Tenant, hash_api_key
from antumbra.platform.ingress.tenants import TenantStore

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 10_000  # keys whose last tenant is kept for a Redis outage


def bearer(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def require_admin(request: Request, admin_key: str | None) -> None:
    """Raise unless the request carries `admin_key` (403 when no admin key is configured)."""
    if admin_key is None:
        raise ApiError(
            403, "the admin API is disabled: no admin key is configured", type="permission_error"
        )
    given = bearer(request)
    if given is None or not hmac.compare_digest(given.encode(), admin_key.encode()):
        raise ApiError(401, "missing or incorrect admin key", code="invalid_api_key")


class Authenticator:
    """API keys to tenants through the tenant store, with the fallback of the module docstring."""

    def __init__(
        self,
        tenants: TenantStore,
        stale_s: float,
        cache_size: int = DEFAULT_CACHE_SIZE,
        health: RedisHealth | None = None,
    ) -> None:
        self.tenants = tenants
        self.stale_s = stale_s
        self.health = health or RedisHealth()
        self.cache_size = cache_size
        self._last: collections.OrderedDict[str, tuple[Tenant, float]] = collections.OrderedDict()

    async def authenticate(self, request: Request) -> Tenant:
        """The caller's tenant; 401 for a missing or unknown key, 503 when Redis cannot tell."""
        api_key = bearer(request)
        if not api_key:
            raise ApiError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        key_hash = hash_api_key(api_key)
        try:
            tenant = await self.tenants.authenticate(api_key)
        except REDIS_ERRORS as exc:
            self.health.failed()
            cached = self._last.get(key_hash)
            if cached is not None and cached[1] >= self.health.last_ok_s - self.stale_s:
                log.warning("tenant store unavailable (%r); using the last known tenant of a key", exc)
                return cached[0]
            raise unavailable("authentication is temporarily unavailable") from None
        self.health.ok()
        if tenant is None:
            self._last.pop(key_hash, None)
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")
        self._remember(key_hash, tenant)
        return tenant

    def _remember(self, key_hash: str, tenant: Tenant) -> None:
        self._last[key_hash] = (tenant, self.health.now())
        self._last.move_to_end(key_hash)
        while len(self._last) > self.cache_size:
            self._last.popitem(last=False)

    def forget(self, tenant_id: str) -> None:
        """Drop the fallback copies of a changed tenant (they must not outlive a rotation)."""
        for key_hash in [h for h, (t, _) in self._last.items() if t.id == tenant_id]:
            del self._last[key_hash]
