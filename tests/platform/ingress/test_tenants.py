"""The tenant store against a real redis-server: keys only hashed, namespaces derived on the server."""

from __future__ import annotations

import asyncio
import hashlib
import string
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from redis.asyncio import Redis

from antumbra.platform.ingress.tenant_file import TenantFileError
from antumbra.platform.ingress.tenant_spec import (
    API_KEY_PREFIX,
    SHARED_NAMESPACE,
    ApiKeyConflict,
    Tenant,
    TenantExists,
    TenantNotFound,
    TenantSpec,
    TenantUpdate,
    derive_cache_namespace,
    hash_api_key,
)
from antumbra.platform.ingress.tenants import TenantStore
from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.replicas.tenancy import Tenancy

SECRET = b"test-namespace-secret"
T = TypeVar("T")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


def run(url: str, body: Callable[[Redis], Awaitable[T]]) -> T:
    """Run `body` with a client on an empty database."""

    async def main() -> T:
        client = Redis.from_url(url, socket_timeout=2)
        try:
            await client.flushdb()
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


async def dump_redis(client: Redis) -> list[bytes]:
    """Every key name and every stored value, as bytes."""
    out: list[bytes] = []
    async for key in client.scan_iter(count=1000):
        out.append(key)
        kind = (await client.type(key)).decode()
        if kind == "string":
            out.append(await client.get(key))
        elif kind == "set":
            out.extend(await client.smembers(key))
        elif kind == "hash":
            for field, value in (await client.hgetall(key)).items():
                out += [field, value]
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {key!r}")
    return out


def test_create_authenticate_and_get(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        spec = TenantSpec(id="acme", rpm=60, tpm=10_000, max_concurrency=4, priority=2, models=["tiny"])
        tenant, key = await store.create(spec)
        assert key.startswith(API_KEY_PREFIX) and len(key) == len(API_KEY_PREFIX) + 43
        assert tenant == Tenant(
            id="acme",
            rpm=60,
            tpm=10_000,
            max_concurrency=4,
            priority=2,
            models=("tiny",),
            cache_scope="private",
            cache_namespace=derive_cache_namespace(SECRET, "acme", "private"),
        )
        assert tenant.allows_model("tiny") and not tenant.allows_model("other")
        assert await store.authenticate(key) == tenant
        assert await store.get("acme") == tenant
        assert tenant.to_spec() == spec
        assert await store.authenticate(key + "x") is None
        assert await store.authenticate("") is None
        assert await store.authenticate(key.upper()) is None
        with pytest.raises(TenantExists, match="'acme' already exists"):
            await store.create(TenantSpec(id="acme"))
        # The failed create left the first key working.
        assert await store.authenticate(key) == tenant

    run(redis_url, body)


def test_keys_are_stored_only_hashed(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        _, key = await store.create(TenantSpec(id="a"))
        rotated = await store.rotate_key("a")
        _, other = await store.create(TenantSpec(id="b", cache_scope="shared"))
        stored = b"\n".join(await dump_redis(client))
        for plaintext in (key, rotated, other):
            assert plaintext.encode() not in stored
            # Nor the random part alone.
            assert plaintext.removeprefix(API_KEY_PREFIX).encode() not in stored
        assert hash_api_key(rotated).encode() in stored
        assert hash_api_key(other).encode() in stored
        assert hash_api_key(key).encode() not in stored  # rotated away
        assert hash_api_key(rotated) == hashlib.sha256(rotated.encode()).hexdigest()

    run(redis_url, body)


def test_list_get_and_not_found(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        assert await store.list() == []
        for tid in ("zeta", "alpha", "mid_1"):
            await store.create(TenantSpec(id=tid))
        assert [t.id for t in await store.list()] == ["alpha", "mid_1", "zeta"]
        for missing in ("nobody", "bad:id", "", "x" * 65):
            with pytest.raises(TenantNotFound):
                await store.get(missing)

    run(redis_url, body)


def test_update_is_partial_and_null_limits_mean_unlimited(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        tenant, key = await store.create(TenantSpec(id="acme", rpm=60, tpm=1000, priority=1, models=["m"]))
        updated = await store.update("acme", TenantUpdate(rpm=120))
        assert (updated.rpm, updated.tpm, updated.priority, updated.models) == (120, 1000, 1, ("m",))
        updated = await store.update("acme", TenantUpdate.model_validate({"tpm": None, "models": None}))
        assert (updated.rpm, updated.tpm, updated.models) == (120, None, None)
        assert updated.cache_namespace == tenant.cache_namespace
        shared = await store.update("acme", TenantUpdate(cache_scope="shared"))
        assert shared.cache_namespace == SHARED_NAMESPACE
        assert await store.authenticate(key) == shared
        assert await store.get("acme") == shared
        with pytest.raises(TenantNotFound):
            await store.update("ghost", TenantUpdate(rpm=1))

    run(redis_url, body)


def test_scheduling_fields_are_stored_and_travel_as_the_tenancy(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("- id: batchy\n  weight: 0.5\n  priority_class: batch\n  tpot_slo_s: 0.2\n")

    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        tenant, key = await store.create(TenantSpec(id="acme", weight=3, ttft_slo_s=0.5))
        assert tenant.tenancy() == Tenancy("acme", 3.0, "interactive", 0.5, None)
        updated = await store.update("acme", TenantUpdate(priority_class="batch", tpot_slo_s=0.05))
        assert updated.tenancy() == Tenancy("acme", 3.0, "batch", 0.5, 0.05)
        cleared = await store.update("acme", TenantUpdate.model_validate({"ttft_slo_s": None}))
        assert (cleared.weight, cleared.ttft_slo_s, cleared.tpot_slo_s) == (3.0, None, 0.05)
        assert await store.authenticate(key) == cleared
        (batchy,) = await store.load_yaml(path)
        assert batchy.tenancy() == Tenancy("batchy", 0.5, "batch", None, 0.2)

    run(redis_url, body)


def test_spec_and_update_validation() -> None:
    for bad_id in ("", "x" * 65, "a:b", "a b", "a/b", "ü"):
        with pytest.raises(ValidationError):
            TenantSpec(id=bad_id)
    TenantSpec(id="A-z_0" + "x" * 59)
    for bad in ({"rpm": 0}, {"tpm": -1}, {"max_concurrency": 0}, {"cache_scope": "global"}, {"weight": 0},
                {"weight": "inf"}, {"priority_class": "urgent"}, {"ttft_slo_s": 0}, {"tpot_slo_s": -0.1}):
        with pytest.raises(ValidationError):
            TenantSpec.model_validate({"id": "a", **bad})
        with pytest.raises(ValidationError):
            TenantUpdate.model_validate(bad)
    # A client cannot choose its namespace or salt: such fields are refused, not silently kept.
    for smuggled in ({"cache_namespace": "victim"}, {"cache_salt": "victim"}):
        with pytest.raises(ValidationError):
            TenantSpec.model_validate({"id": "a", **smuggled})
        with pytest.raises(ValidationError):
            TenantUpdate.model_validate(smuggled)
    for null in ({"priority": None}, {"cache_scope": None}, {"weight": None}, {"priority_class": None}):
        with pytest.raises(ValidationError, match="not null"):
            TenantUpdate.model_validate(null)
    with pytest.raises(ValidationError):
        TenantUpdate.model_validate({"id": "renamed"})


def test_delete_removes_the_tenant_and_its_key_hashes(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        _, key = await store.create(TenantSpec(id="gone"))
        kept, kept_key = await store.create(TenantSpec(id="kept"))
        await store.delete("gone")
        assert await store.authenticate(key) is None
        assert await store.authenticate(kept_key) == kept
        assert [t.id for t in await store.list()] == ["kept"]
        stored = b"\n".join(await dump_redis(client))
        assert hash_api_key(key).encode() not in stored and b"gone" not in stored
        with pytest.raises(TenantNotFound):
            await store.delete("gone")
        with pytest.raises(TenantNotFound):
            await store.get("gone")
        # The id is free again, with a new key.
        _, again = await store.create(TenantSpec(id="gone"))
        assert again != key and (await store.authenticate(again)) is not None

    run(redis_url, body)


def test_rotate_key_invalidates_the_old_key_at_once(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        tenant, old = await store.create(TenantSpec(id="acme"))
        new = await store.rotate_key("acme")
        assert new != old and new.startswith(API_KEY_PREFIX)
        assert await store.authenticate(old) is None
        assert await store.authenticate(new) == tenant
        # A second store (another ingress replica) sees the same at once.
        assert await TenantStore(client, namespace_secret=SECRET).authenticate(old) is None
        with pytest.raises(TenantNotFound):
            await store.rotate_key("ghost")

    run(redis_url, body)


def test_namespaces_are_derived_on_the_server(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTUMBRA_NAMESPACE_SECRET", raising=False)

    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        a, _ = await store.create(TenantSpec(id="a"))
        b, _ = await store.create(TenantSpec(id="b"))
        s1, _ = await store.create(TenantSpec(id="s1", cache_scope="shared"))
        s2, _ = await store.create(TenantSpec(id="s2", cache_scope="shared"))
        assert a.cache_namespace != b.cache_namespace
        assert len(a.cache_namespace) == 64 and int(a.cache_namespace, 16) >= 0
        assert "a" != a.cache_namespace and SHARED_NAMESPACE not in (a.cache_namespace, b.cache_namespace)
        assert s1.cache_namespace == s2.cache_namespace == SHARED_NAMESPACE
        # Another secret gives other namespaces for the same ids.
        other = await TenantStore(client, namespace_secret=b"another secret").get("a")
        assert other.cache_namespace != a.cache_namespace

        # Without a configured secret, replicas sharing a Redis agree on one kept there.
        first = await TenantStore(client).get("a")
        second = await TenantStore(client).get("a")
        assert first.cache_namespace == second.cache_namespace != a.cache_namespace

    run(redis_url, body)


def test_namespace_secret_from_the_environment(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTUMBRA_NAMESPACE_SECRET", SECRET.decode())

    async def body(client: Redis) -> None:
        tenant, _ = await TenantStore(client).create(TenantSpec(id="a"))
        assert tenant.cache_namespace == derive_cache_namespace(SECRET, "a", "private")

    run(redis_url, body)


ID_CHARS = string.ascii_letters + string.digits + "_-"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(ID_CHARS, min_size=1, max_size=64), min_size=2, max_size=8, unique=True))
def test_distinct_ids_never_share_a_private_namespace(ids: list[str]) -> None:
    namespaces = {derive_cache_namespace(SECRET, i, "private") for i in ids}
    assert len(namespaces) == len(ids) and SHARED_NAMESPACE not in namespaces


def test_concurrent_creates_of_one_id_admit_exactly_one(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        results = await asyncio.gather(
            *(store.create(TenantSpec(id="race", rpm=i + 1)) for i in range(8)), return_exceptions=True
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        assert len(winners) == 1
        assert all(isinstance(r, TenantExists) for r in results if isinstance(r, BaseException))
        tenant, key = winners[0]
        assert await store.authenticate(key) == tenant == await store.get("race")
        assert len(await client.keys("*:key:*")) == 1

    run(redis_url, body)


def _sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def test_yaml_file_with_hashed_keys_authenticates_the_plaintext(redis_url: str, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        "  - id: acme\n"
        "    rpm: 60\n"
        "    tpm: 100000\n"
        "    models: [tiny]\n"
        f"    api_key: {_sha('sk-ant-acme-one')}\n"
        "  - id: globex\n"
        "    cache_scope: shared\n"
        f"    api_keys: ['{_sha('sk-ant-globex-1')}', "
        f"'{_sha('sk-ant-globex-2').upper().replace('SHA256', 'sha256')}']\n"
        "  - id: keyless\n"
    )

    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        loaded = await store.load_yaml(path)
        assert [t.id for t in loaded] == ["acme", "globex", "keyless"]
        acme = await store.authenticate("sk-ant-acme-one")
        assert acme is not None and (acme.id, acme.rpm, acme.tpm, acme.models) == (
            "acme",
            60,
            100000,
            ("tiny",),
        )
        for key in ("sk-ant-globex-1", "sk-ant-globex-2"):
            globex = await store.authenticate(key)
            assert globex is not None and globex.cache_namespace == SHARED_NAMESPACE
        assert await store.authenticate("sk-ant-acme-two") is None
        assert (await store.get("keyless")).rpm is None

        # Loading again upserts: a changed limit applies, a changed key replaces the old one,
        # and a tenant given no keys keeps the one it got through the API.
        keyless_key = await store.rotate_key("keyless")
        path.write_text(
            f"- id: acme\n  rpm: 30\n  api_key: {_sha('sk-ant-acme-two')}\n- id: keyless\n  priority: 5\n"
        )
        await store.load_yaml(path)
        assert await store.authenticate("sk-ant-acme-one") is None
        acme = await store.authenticate("sk-ant-acme-two")
        assert acme is not None and acme.rpm == 30 and acme.models is None
        keyless = await store.authenticate(keyless_key)
        assert keyless is not None and keyless.priority == 5
        assert await store.authenticate("sk-ant-globex-1") is not None  # not in the file: untouched

        # A key hash already owned by another tenant is refused.
        path.write_text(f"- id: intruder\n  api_key: {_sha('sk-ant-acme-two')}\n")
        with pytest.raises(ApiKeyConflict, match="'acme'"):
            await store.load_yaml(path)
        with pytest.raises(TenantNotFound):
            await store.get("intruder")

    run(redis_url, body)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("- id: a\n  api_key: sk-ant-plaintext\n", "never in plaintext"),
        ("- id: a\n  api_key: sha256:abc\n", "sha256:<64 hex digits>"),
        ("- id: 'bad id'\n", "tenant #2"),
        ("- id: a\n  rpm: 0\n", "rpm"),
        ("- id: a\n  surprise: 1\n", "surprise"),
        ("- id: a\n- id: a\n", "more than once"),
        (f"- id: a\n  api_key: {_sha('k')}\n- id: b\n  api_key: {_sha('k')}\n", "same API key"),
        ("just a string\n", "expected a list"),
        ("- id: [unclosed\n", "cannot read"),
    ],
)
def test_bad_tenant_files_store_nothing(redis_url: str, tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("- id: first_ok\n" + text if text.startswith("- ") else text)

    async def body(client: Redis) -> None:
        store = TenantStore(client, namespace_secret=SECRET)
        with pytest.raises(TenantFileError, match=match):
            await store.load_yaml(path)
        assert await store.list() == []

    run(redis_url, body)


def test_missing_tenant_file_is_a_clear_error(redis_url: str, tmp_path: Path) -> None:
    async def body(client: Redis) -> None:
        with pytest.raises(TenantFileError, match="cannot read tenants file"):
            await TenantStore(client, namespace_secret=SECRET).load_yaml(tmp_path / "absent.yaml")

    run(redis_url, body)
