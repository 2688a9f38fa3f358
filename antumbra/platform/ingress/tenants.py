"""Tenants and their API keys, stored in Redis.

A tenant is an id, its limits (requests/min, tokens/min, concurrency), a
priority, the models it may use, and a cache scope. Its cache namespace -- the
seed of every block hash its requests produce -- is derived here, on the server,
from the tenant id and a server secret; nothing a client sends enters it.

API keys are stored only as `sha256(key)` hex. A key has 256 random bits, so a
fast hash is enough (no password stretching), and authentication is one lookup
by hash, which leaves no secret-dependent string comparison to time.

Redis layout, all under one hash tag so that every transaction below touches a
single Redis Cluster slot:

    {<prefix>:tenants}:ids              SET of tenant ids
    {<prefix>:tenants}:t:<id>           STRING: the tenant's spec as JSON
    {<prefix>:tenants}:t:<id>:keys      SET of the tenant's key hashes
    {<prefix>:tenants}:key:<sha256>     STRING: the tenant id a key hash belongs to
    {<prefix>:tenants}:namespace-secret STRING: the namespace secret, when none is configured

Every write is a WATCH/MULTI transaction, so the key index never points at a
tenant that is gone or at a key that was rotated away.
"""

from __future__ import annotations

import builtins
import hashlib
import hmac
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.exceptions import WatchError

from antumbra import env

API_KEY_PREFIX = "sk-ant-"
SHARED_NAMESPACE = "shared"
_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_HASHED_KEY = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_NAMESPACE_DOMAIN = b"antumbra/cache-namespace/v1"
_TXN_RETRIES = 16

CacheScope = Literal["private", "shared"]
TenantId = Annotated[str, Field(pattern=_ID_PATTERN, description="1-64 characters of [A-Za-z0-9_-]")]
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


class TenantFileError(TenantError):
    """A tenants YAML file that cannot be read or does not validate; nothing from it was stored."""


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


class TenantUpdate(BaseModel):
    """A partial update: fields left out stay as they are; a limit set to null becomes unlimited."""

    model_config = ConfigDict(extra="forbid")

    rpm: PositiveLimit | None = None
    tpm: PositiveLimit | None = None
    max_concurrency: PositiveLimit | None = None
    priority: int | None = None
    models: list[str] | None = None
    cache_scope: CacheScope | None = None

    @field_validator("priority", "cache_scope", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # These have defaults rather than an "unlimited" meaning, so null is a mistake, not a reset.
        if value is None:
            raise ValueError("may be left out but not null")
        return value


class _TenantFileEntry(TenantSpec):
    """One entry of a tenants file: a spec plus key hashes, never plaintext keys."""

    api_key: str | None = None
    api_keys: list[str] = Field(default_factory=list)

    @field_validator("api_key")
    @classmethod
    def _one_hashed(cls, value: str | None) -> str | None:
        return None if value is None else _parse_hashed_key(value)

    @field_validator("api_keys")
    @classmethod
    def _all_hashed(cls, values: list[str]) -> list[str]:
        return [_parse_hashed_key(v) for v in values]

    def key_hashes(self) -> list[str]:
        hashes = list(self.api_keys)
        if self.api_key is not None:
            hashes.append(self.api_key)
        return sorted(set(hashes))

    def spec(self) -> TenantSpec:
        return TenantSpec.model_validate(self.model_dump(exclude={"api_key", "api_keys"}))


def _parse_hashed_key(value: str) -> str:
    match = _HASHED_KEY.match(value.strip())
    if match is None:
        raise ValueError(
            "API keys in a tenants file must be given as sha256:<64 hex digits> "
            '(for example `printf %s "$KEY" | sha256sum`), never in plaintext'
        )
    return match.group(1).lower()


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
        )


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


# --- the store -----------------------------------------------------------------


class TenantStore:
    """Tenants and key hashes in Redis, through a `redis.asyncio` client.

    `namespace_secret` None takes `ANTUMBRA_NAMESPACE_SECRET`, and failing that a
    random secret kept in Redis (created once, with SET NX), so every ingress
    replica that shares the Redis derives the same namespaces.
    """

    def __init__(
        self,
        redis_client: aioredis.Redis,
        key_prefix: str = "antumbra",
        *,
        namespace_secret: bytes | None = None,
    ) -> None:
        self._redis = redis_client
        self._base = f"{{{key_prefix}:tenants}}"
        self._secret = namespace_secret if namespace_secret is not None else env.namespace_secret()

    # --- key names --

    def _ids_key(self) -> str:
        return f"{self._base}:ids"

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self._base}:t:{tenant_id}"

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return f"{self._base}:t:{tenant_id}:keys"

    def _api_key_key(self, key_hash: str) -> str:
        return f"{self._base}:key:{key_hash}"

    # --- reads --

    async def get(self, tenant_id: str) -> Tenant:
        """The tenant with this id; raises `TenantNotFound`."""
        raw = await self._redis.get(self._tenant_key(tenant_id)) if _valid_id(tenant_id) else None
        if raw is None:
            raise TenantNotFound(tenant_id)
        return await self._to_tenant(_spec_from_json(raw))

    async def list(self) -> builtins.list[Tenant]:
        """Every tenant, sorted by id."""
        ids = sorted(_text(i) for i in await self._redis.smembers(self._ids_key()))
        if not ids:
            return []
        raws = await self._redis.mget([self._tenant_key(i) for i in ids])
        return [await self._to_tenant(_spec_from_json(raw)) for raw in raws if raw is not None]

    async def authenticate(self, api_key: str) -> Tenant | None:
        """The tenant an API key belongs to, or None for an unknown, rotated or deleted key."""
        if not api_key:
            return None
        owner = await self._redis.get(self._api_key_key(hash_api_key(api_key)))
        if owner is None:
            return None
        try:
            return await self.get(_text(owner))
        except TenantNotFound:
            return None  # deleted between the two reads

    # --- writes --

    async def create(self, spec: TenantSpec) -> tuple[Tenant, str]:
        """Store a new tenant with a fresh API key; return it and the key (shown once, stored hashed)."""
        api_key = new_api_key()
        key_hash = hash_api_key(api_key)

        async def txn(pipe: Any) -> None:
            if await pipe.exists(self._tenant_key(spec.id)):
                raise TenantExists(spec.id)
            pipe.multi()
            self._queue_put(pipe, spec)
            pipe.sadd(self._tenant_keys_key(spec.id), key_hash)
            pipe.set(self._api_key_key(key_hash), spec.id)

        await self._transaction([self._tenant_key(spec.id)], txn)
        return await self._to_tenant(spec), api_key

    async def update(self, tenant_id: str, update: TenantUpdate) -> Tenant:
        """Apply the fields set in `update`; raises `TenantNotFound`."""
        result: builtins.list[TenantSpec] = []

        async def txn(pipe: Any) -> None:
            raw = await pipe.get(self._tenant_key(tenant_id)) if _valid_id(tenant_id) else None
            if raw is None:
                raise TenantNotFound(tenant_id)
            merged = _spec_from_json(raw).model_dump() | update.model_dump(exclude_unset=True)
            spec = TenantSpec.model_validate(merged)
            pipe.multi()
            self._queue_put(pipe, spec)
            result[:] = [spec]

        await self._transaction([self._tenant_key(tenant_id)], txn)
        return await self._to_tenant(result[0])

    async def delete(self, tenant_id: str) -> None:
        """Remove the tenant and every key hash it had; raises `TenantNotFound`."""

        async def txn(pipe: Any) -> None:
            if not _valid_id(tenant_id) or not await pipe.exists(self._tenant_key(tenant_id)):
                raise TenantNotFound(tenant_id)
            hashes = [_text(h) for h in await pipe.smembers(self._tenant_keys_key(tenant_id))]
            pipe.multi()
            for h in hashes:
                pipe.delete(self._api_key_key(h))
            pipe.delete(self._tenant_key(tenant_id), self._tenant_keys_key(tenant_id))
            pipe.srem(self._ids_key(), tenant_id)

        await self._transaction([self._tenant_key(tenant_id), self._tenant_keys_key(tenant_id)], txn)

    async def rotate_key(self, tenant_id: str) -> str:
        """Replace all of the tenant's keys with one fresh key; the old ones stop working at once."""
        api_key = new_api_key()
        await self._replace_keys(tenant_id, [hash_api_key(api_key)], spec=None)
        return api_key

    async def upsert(self, spec: TenantSpec, key_hashes: Iterable[str] | None = None) -> Tenant:
        """Create or overwrite a tenant; `key_hashes` (sha256 hex) replace its keys, None keeps them."""
        await self._replace_keys(spec.id, None if key_hashes is None else list(key_hashes), spec=spec)
        return await self._to_tenant(spec)

    async def load_yaml(self, path: str | Path) -> builtins.list[Tenant]:
        """Upsert every tenant in a YAML file; keys appear only as `sha256:<hex>`.

        The file is a list of entries, or a mapping with a `tenants:` list. Each
        entry is a `TenantSpec` plus `api_key` and/or `api_keys`. Listed keys
        replace the tenant's stored keys; an entry without keys keeps them. The
        whole file is validated before anything is written.
        """
        entries = _read_tenant_file(Path(path))
        return [await self.upsert(e.spec(), e.key_hashes() or None) for e in entries]

    # --- internals --

    async def _replace_keys(
        self, tenant_id: str, key_hashes: builtins.list[str] | None, spec: TenantSpec | None
    ) -> None:
        watched = [self._tenant_key(tenant_id), self._tenant_keys_key(tenant_id)]
        watched += [self._api_key_key(h) for h in key_hashes or []]

        async def txn(pipe: Any) -> None:
            if spec is None and not (_valid_id(tenant_id) and await pipe.exists(self._tenant_key(tenant_id))):
                raise TenantNotFound(tenant_id)
            old = {_text(h) for h in await pipe.smembers(self._tenant_keys_key(tenant_id))}
            for h in key_hashes or []:
                owner = await pipe.get(self._api_key_key(h))
                if owner is not None and _text(owner) != tenant_id:
                    raise ApiKeyConflict(tenant_id, _text(owner))
            pipe.multi()
            if spec is not None:
                self._queue_put(pipe, spec)
            if key_hashes is not None:
                for h in old - set(key_hashes):
                    pipe.delete(self._api_key_key(h))
                pipe.delete(self._tenant_keys_key(tenant_id))
                if key_hashes:
                    pipe.sadd(self._tenant_keys_key(tenant_id), *key_hashes)
                for h in key_hashes:
                    pipe.set(self._api_key_key(h), tenant_id)

        await self._transaction(watched, txn)

    def _queue_put(self, pipe: Any, spec: TenantSpec) -> None:
        pipe.set(self._tenant_key(spec.id), spec.model_dump_json())
        pipe.sadd(self._ids_key(), spec.id)

    async def _transaction(self, watch: builtins.list[str], body: Callable[[Any], Awaitable[None]]) -> None:
        """Run `body` under WATCH and EXEC its queued writes; retry when a watched key changed."""
        for _ in range(_TXN_RETRIES):
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(*watch)
                    await body(pipe)
                    await pipe.execute()
                    return
                except WatchError:
                    continue
        raise TenantError(f"gave up after {_TXN_RETRIES} conflicting concurrent writes to {watch[0]}")

    async def _namespace_secret(self) -> bytes:
        if self._secret is None:
            key = f"{self._base}:namespace-secret"
            # NX: the first replica to get here picks the secret, every other one reads it.
            await self._redis.set(key, secrets.token_hex(32), nx=True)
            stored = await self._redis.get(key)
            if stored is None:
                raise TenantError(f"the namespace secret at {key} vanished right after it was written")
            self._secret = _text(stored).encode()
        return self._secret

    async def _to_tenant(self, spec: TenantSpec) -> Tenant:
        secret = await self._namespace_secret()
        return Tenant(
            id=spec.id,
            rpm=spec.rpm,
            tpm=spec.tpm,
            max_concurrency=spec.max_concurrency,
            priority=spec.priority,
            models=tuple(spec.models) if spec.models is not None else None,
            cache_scope=spec.cache_scope,
            cache_namespace=derive_cache_namespace(secret, spec.id, spec.cache_scope),
        )


def _valid_id(tenant_id: str) -> bool:
    # Keeps ids that could never have been stored (e.g. containing ':') out of key names.
    return re.fullmatch(_ID_PATTERN, tenant_id) is not None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _spec_from_json(raw: bytes | str) -> TenantSpec:
    return TenantSpec.model_validate_json(raw)


def _read_tenant_file(path: Path) -> list[_TenantFileEntry]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TenantFileError(f"cannot read tenants file {path}: {exc}") from exc
    if isinstance(data, dict) and set(data) == {"tenants"}:
        data = data["tenants"]
    if data is None:
        return []
    if not isinstance(data, list):
        raise TenantFileError(f"{path}: expected a list of tenants or a mapping with a `tenants:` list")
    entries: list[_TenantFileEntry] = []
    for i, item in enumerate(data):
        try:
            entries.append(_TenantFileEntry.model_validate(item))
        except ValidationError as exc:
            raise TenantFileError(f"{path}: tenant #{i + 1}: {_short(exc)}") from exc
    ids = [e.id for e in entries]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise TenantFileError(f"{path}: tenant ids appear more than once: {', '.join(dupes)}")
    owners: dict[str, str] = {}
    for e in entries:
        for h in e.key_hashes():
            if owners.setdefault(h, e.id) != e.id:
                raise TenantFileError(f"{path}: tenants {owners[h]!r} and {e.id!r} list the same API key")
    return entries


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'entry'}: {err['msg']}" for err in exc.errors()
    )
