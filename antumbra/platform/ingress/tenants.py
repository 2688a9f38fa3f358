"""Tenants and their API keys, stored in Redis.

What a tenant is, its key hashes and its cache namespace are in `tenant_spec`; the tenants YAML
file is read in `tenant_file`. This module keeps them in Redis.

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
import secrets
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from antumbra import env
from antumbra.platform.ingress.tenant_file import read_tenant_file
from antumbra.platform.ingress.tenant_spec import (
    ApiKeyConflict,
    Tenant,
    TenantError,
    TenantExists,
    TenantNotFound,
    TenantSpec,
    TenantUpdate,
    derive_cache_namespace,
    hash_api_key,
    new_api_key,
    valid_tenant_id,
)

_TXN_RETRIES = 16


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
        raw = await self._redis.get(self._tenant_key(tenant_id)) if valid_tenant_id(tenant_id) else None
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
            raw = await pipe.get(self._tenant_key(tenant_id)) if valid_tenant_id(tenant_id) else None
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
            if not valid_tenant_id(tenant_id) or not await pipe.exists(self._tenant_key(tenant_id)):
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
        entries = read_tenant_file(Path(path))
        return [await self.upsert(e.spec(), e.key_hashes() or None) for e in entries]

    async def load_yaml_once(self, path: str | Path) -> builtins.list[Tenant] | None:
        """`load_yaml` once per file content (None when this content was loaded before), so an
        ingress restart does not undo admin changes made since."""
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        marker = f"{self._base}:file:{digest}"
        if not await self._redis.set(marker, "1", nx=True):
            return None
        try:
            return await self.load_yaml(path)
        except BaseException:
            await self._redis.delete(marker)
            raise

    # --- internals --

    async def _replace_keys(
        self, tenant_id: str, key_hashes: builtins.list[str] | None, spec: TenantSpec | None
    ) -> None:
        watched = [self._tenant_key(tenant_id), self._tenant_keys_key(tenant_id)]
        watched += [self._api_key_key(h) for h in key_hashes or []]

        async def txn(pipe: Any) -> None:
            if spec is None:  # a key rotation: the tenant must exist
                if not (valid_tenant_id(tenant_id) and await pipe.exists(self._tenant_key(tenant_id))):
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
            weight=spec.weight,
            priority_class=spec.priority_class,
            ttft_slo_s=spec.ttft_slo_s,
            tpot_slo_s=spec.tpot_slo_s,
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _spec_from_json(raw: bytes | str) -> TenantSpec:
    return TenantSpec.model_validate_json(raw)
