"""A tenant: the spec an admin writes (pydantic, at the REST and file edge), the view the rest of
the platform sees (`Tenant`), its errors, and the derived secrets: API key hashes and the cache
namespace.

A tenant is an id, its limits (requests/min, tokens/min, concurrency), a priority, the models it
may use, a cache scope, and how the engine's scheduler serves it: a weight (its share against other
tenants'), a priority class (`interactive` before `batch`) and optional SLO targets for time to
first token and time per output token. Its cache namespace -- the seed of every block hash its requests
produce -- is derived here, on the server, from the tenant id and a server secret; nothing a
client sends enters it.

API keys are stored only as `sha256(key)` hex. A key has 256 random bits, so a fast hash is enough
(no password stretching), and authentication is one lookup by hash, which leaves no
secret-dependent string comparison to time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from antumbra.replicas.tenancy import Tenancy

API_KEY_PREFIX = "sk-ant-"
SHARED_NAMESPACE = "shared"
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_NAMESPACE_DOMAIN = b"antumbra/cache-namespace/v1"

CacheScope = Literal["private", "shared"]
PriorityClass = Literal["interactive", "batch"]
Weight = Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)]
SloSeconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
TenantId = Annotated[str, Field(pattern=ID_PATTERN, description="1-64 characters of [A-Za-z0-9_-]")]
PositiveLimit = Annotated[int, Field(ge=1)]


# --- errors -------------------------------------------------------------------


class TenantError(Exception):
    """Base of the tenant store's errors."""


class TenantExists(TenantError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"tenant {tenant_id!r} already exists")
        self.tenant_id = tenant_id


class TenantNotFound(TenantError):
    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"no tenant {tenant_id!r}")
        self.tenant_id = tenant_id


class ApiKeyConflict(TenantError):
    def __init__(self, tenant_id: str, owner: str) -> None:
        super().__init__(f"an API key given for tenant {tenant_id!r} already belongs to tenant {owner!r}")
        self.tenant_id = tenant_id
        self.owner = owner


# --- the REST / file edge -----------------------------------------------------


class TenantSpec(BaseModel):
    """A tenant as an admin writes it. None for a limit means unlimited; None for models means all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: TenantId
    rpm: PositiveLimit | None = None
    tpm: PositiveLimit | None = None
    max_concurrency: PositiveLimit | None = None
    priority: int = 0
    models: list[str] | None = None
    cache_scope: CacheScope = "private"
    weight: Weight = 1.0
    priority_class: PriorityClass = "interactive"
    ttft_slo_s: SloSeconds | None = None
    tpot_slo_s: SloSeconds | None = None


class TenantUpdate(BaseModel):
    """A partial update: fields left out stay as they are; a limit set to null becomes unlimited."""

    model_config = ConfigDict(extra="forbid")

    rpm: PositiveLimit | None = None
    tpm: PositiveLimit | None = None
    max_concurrency: PositiveLimit | None = None
    priority: int | None = None
    models: list[str] | None = None
    cache_scope: CacheScope | None = None
    weight: Weight | None = None
    priority_class: PriorityClass | None = None
    ttft_slo_s: SloSeconds | None = None  # null: no target
    tpot_slo_s: SloSeconds | None = None

    @field_validator("priority", "cache_scope", "weight", "priority_class", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # These have defaults rather than an "unlimited" meaning, so null is a mistake, not a reset.
        if value is None:
            raise ValueError("may be left out but not null")
        return value


# --- the internal view ---------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """An authenticated tenant as the rest of the platform sees it."""

    id: str
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    priority: int
    models: tuple[str, ...] | None
    cache_scope: CacheScope
    cache_namespace: str
    weight: float = 1.0
    priority_class: PriorityClass = "interactive"
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def to_spec(self) -> TenantSpec:
        return TenantSpec(
            id=self.id,
            rpm=self.rpm,
            tpm=self.tpm,
            max_concurrency=self.max_concurrency,
            priority=self.priority,
            models=list(self.models) if self.models is not None else None,
            cache_scope=self.cache_scope,
            weight=self.weight,
            priority_class=self.priority_class,
            ttft_slo_s=self.ttft_slo_s,
            tpot_slo_s=self.tpot_slo_s,
        )

    def tenancy(self) -> Tenancy:
        """What travels with each of its requests to the engine's scheduler."""
        return Tenancy(self.id, self.weight, self.priority_class, self.ttft_slo_s, self.tpot_slo_s)


def hash_api_key(api_key: str) -> str:
    """The stored form of an API key: sha256 of its UTF-8 bytes, lowercase hex."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    """A fresh key: the `sk-ant-` prefix and 32 random bytes, URL-safe base64."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def derive_cache_namespace(secret: bytes, tenant_id: str, scope: CacheScope) -> str:
    """The cache namespace of a tenant.

    Shared scope: the fixed `SHARED_NAMESPACE`, the same for every shared tenant.
    Private scope: HMAC-SHA256(secret, domain || len(id) || id) in hex. The length
    prefix keeps distinct ids from encoding to the same bytes, and the secret keeps
    a client who knows a tenant id from computing its namespace. A private
    namespace is 64 hex digits, so it can never equal the shared one.
    """
    if scope == "shared":
        return SHARED_NAMESPACE
    raw = tenant_id.encode()
    message = _NAMESPACE_DOMAIN + len(raw).to_bytes(4, "big") + raw
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def valid_tenant_id(tenant_id: str) -> bool:
    # Keeps ids that could never have been stored (e.g. containing ':') out of key names.
    return re.fullmatch(ID_PATTERN, tenant_id) is not None
