"""The ingress deployment: OpenAI-compatible REST in front of the model deployments.

Per generation request, in this order (each step answers in OpenAI's error shape):

  1. auth: `Authorization: Bearer <key>` → tenant (401 missing or unknown key);
  2. body: read at most `max_body_bytes` (413, from Content-Length and while reading), JSON (400);
  3. model: known (404) and allowed for the tenant (403);
  4. parameters: validated with the OpenAI field names (400 naming `param`); unsupported options 400;
  5. tokenize (chat template for chat) and check the context (400 `context_length_exceeded`);
  6. limits: GCRA requests/min and tokens/min (tokens charged as prompt + max_tokens, corrected to
     the real count at the end) and max concurrency (429 with `Retry-After`, `x-ratelimit-*`);
  7. block hashes of the prompt in the cache namespace `f"{model}:{tenant.cache_namespace}"`, the
     same string the engine gets as `namespace`, so engine cache and prefix directory agree;
  8. the model deployment, through a streaming handle (the request router reads the hashes);
     over capacity (`max_queued_requests`) is a 503; a replica that dies before the first token
     is retried on another replica (`max_retries`), after it the stream ends with an SSE error
     event and `[DONE]` (non-streaming: 503), never a hang (`stream_idle_timeout_s`).

A client disconnect cancels the handler; the handle call is cancelled with it and the replica's
engine aborts the request.

Redis down (documented choice): authentication asks Redis on every request (so a rotated or
deleted key stops working at once), and keeps the last answer per key; while Redis fails, a key
seen in the last `auth_stale_s` seconds is still accepted, any other key gets 503 (fail closed).
Rate and concurrency limits fail open (the request is served unlimited and a warning is logged):
a quota store outage must not take the whole API down, and quotas resume when Redis is back.
"""

# No `from __future__ import annotations` here: FastAPI must resolve `Request` in the route
# signatures that Ray Serve rewrites for class-based views, outside this module's globals.
import asyncio
import collections
import contextlib
import hashlib
import hmac
import importlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from antumbra.cachestore.block_hash import block_hashes
from antumbra.platform import openai_schema as oa
from antumbra.platform.model_server import GenerateRequest
from antumbra.platform.ratelimit import (
    ConcurrencyLimiter,
    Decision,
    Lease,
    Limit,
    RateLimiter,
    retry_after_header,
)
from antumbra.platform.tenants import (
    ApiKeyConflict,
    Tenant,
    TenantError,
    TenantExists,
    TenantNotFound,
    TenantSpec,
    TenantStore,
    TenantUpdate,
    hash_api_key,
)
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_REDIS_ERRORS = (RedisError, OSError, TimeoutError)
_REPLICA_GONE = (RayActorError, ActorUnavailableError)
_AUTH_CACHE_SIZE = 10_000
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass(frozen=True)
class IngressSettings:
    """What one ingress replica needs; `app.py` derives it from `PlatformConfig`."""

    redis_url: str
    model_paths: Mapping[str, str]  # served model name -> checkpoint directory (for its tokenizer)
    admin_key: str | None = None
    tenants_file: str | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 512  # chat requests without max_tokens (capped by the context)
    stream_idle_timeout_s: float = 120.0
    model_info_timeout_s: float = 60.0
    max_retries: int = 2
    auth_stale_s: float = 300.0
    redis_timeout_s: float = 0.5
    key_prefix: str = "antumbra"
    request_observer: str | None = None  # "module:callable" called with each RequestRecord


@dataclass(frozen=True)
class RequestRecord:
    """One finished generation request, for metrics (`IngressSettings.request_observer`)."""

    tenant_id: str | None
    model: str | None
    endpoint: str
    status: int
    stream: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    duration_s: float = 0.0
    error_type: str | None = None


# --------------------------------------------------------------------------------------------- FastAPI app

api = FastAPI(title="Antumbra", version="0.1.0", description="OpenAI-compatible multi-tenant LLM serving")


def _error_response(err: oa.ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


@api.exception_handler(oa.ApiError)
async def _on_api_error(_: Request, exc: oa.ApiError) -> JSONResponse:
    return _error_response(exc)


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(oa.validation_error(exc.errors()))


@api.exception_handler(StarletteHTTPException)
async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    err = oa.ApiError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
    return _error_response(err)


@api.exception_handler(Exception)
async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in the ingress")
    return _error_response(
        oa.ApiError(500, "internal server error", type="server_error", code="internal_error")
    )


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body that the handler parses itself (to order the checks)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": oa.ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 503)
}


def _openapi() -> dict[str, Any]:
    """FastAPI's schema plus the request bodies the handlers parse themselves."""
    if api.openapi_schema:
        return api.openapi_schema
    schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    documented: tuple[type[BaseModel], ...] = (*oa.REQUEST_MODELS, TenantSpec, TenantUpdate)
    for model in documented:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    api.openapi_schema = schema
    return schema


api.openapi = _openapi  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------- admission


@dataclass
class _Admission:
    """What an admitted request holds: its token charge and its concurrency lease.

    `settle(used_tokens)` corrects the tokens/min charge to what the request really used and
    releases the lease; it runs once, in a task of its own, so a cancelled handler still settles.
    """

    limiter: RateLimiter | None
    concurrency: ConcurrencyLimiter | None
    tpm_limit: Limit | None
    lease: Lease | None
    headers: dict[str, str]
    renewer: asyncio.Task | None = None  # keeps the lease alive while the request runs
    _settled: bool = False

    def settle(self, used_tokens: int, tasks: set[asyncio.Task]) -> None:
        if self._settled:
            return
        self._settled = True
        if self.renewer is not None:
            self.renewer.cancel()
        task = asyncio.get_running_loop().create_task(self._settle(used_tokens))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _settle(self, used_tokens: int) -> None:
        try:
            if self.limiter is not None and self.tpm_limit is not None and used_tokens != self.tpm_limit.cost:
                lim = self.tpm_limit
                await self.limiter.adjust(lim.key, lim.rate_per_min, used_tokens - lim.cost, lim.burst)
        except _REDIS_ERRORS as exc:
            log.warning("could not correct the token charge of %s: %r", self.tpm_limit, exc)
        try:
            if self.concurrency is not None and self.lease is not None:
                await self.concurrency.release(self.lease)
        except _REDIS_ERRORS as exc:  # the lease lapses by itself
            log.warning("could not release a concurrency lease: %r", exc)


async def _renew_lease(limiter: ConcurrencyLimiter, lease: Lease) -> None:
    """Renew a lease every third of its length, so a long request keeps its slot."""
    while True:
        await asyncio.sleep(limiter.lease_s / 3)
        with contextlib.suppress(*_REDIS_ERRORS):  # a transient error: the next round tries again
            if await limiter.renew(lease) is None:
                return


def _ratelimit_headers(kind: str, decision: Decision) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(decision.limit),
        f"x-ratelimit-remaining-{kind}": str(max(decision.remaining, 0)),
        f"x-ratelimit-reset-{kind}": f"{decision.reset_after_s:.3f}s",
    }


# --------------------------------------------------------------------------------------------- models


@dataclass
class _Model:
    name: str
    handle: Any  # DeploymentHandle
    stream_handle: Any
    tokenizer: Tokenizer
    info: dict[str, Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class _Generation:
    """A validated request ready to run, and what the response needs to say about it."""

    kind: oa.Kind
    model: _Model
    tenant: Tenant
    body: Any  # CompletionRequest | ChatCompletionRequest
    gen: GenerateRequest
    response_id: str
    created: int
    started: float
    top_logprobs: int | None  # how many alternatives to report per token, None: no logprobs


@dataclass
class _Finisher:
    """Ends one admitted generation exactly once, however it ends.

    It cancels the replica call if the request did not finish (the engine then aborts it and
    frees its KV), settles the tenant's limits with the tokens really used, and reports the
    request. `abandon()` is the path of a client that went away (status 499).
    """

    acc: oa.ResponseBuilder
    response: Any  # DeploymentResponseGenerator
    admission: _Admission
    tasks: set[asyncio.Task]
    record: Callable[..., RequestRecord]
    observe: Callable[[RequestRecord], None]
    done: bool = False

    def finish(self, status: int, error_type: str | None = None) -> None:
        # No awaits: this runs in `finally` blocks of cancelled tasks too.
        if self.done:
            return
        self.done = True
        if self.acc.finish_reason is None:
            _cancel(self.response)
        self.admission.settle(self.acc.prompt_tokens + self.acc.completion_tokens, self.tasks)
        self.observe(self.record(status, error_type, self.acc))

    def abandon(self) -> None:
        self.finish(499)


class _SSEResponse(StreamingResponse):
    """A streaming response that calls `on_close` however it ends, even if its body never started
    (a client that disconnects before the first event must still release the replica)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# --------------------------------------------------------------------------------------------- helpers


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _short(exc: BaseException) -> str:
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]


def _context_error(max_len: int, prompt: int, completion: int | None, param: str) -> oa.ApiError:
    if completion is None:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, your prompt has {prompt} tokens "
            "(at least one generated token must also fit)."
        )
    else:
        message = (
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the prompt, {completion} for the completion)."
        )
    return oa.invalid(message, param, code="context_length_exceeded")


def _sampling_params(body: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
        )
    except ValueError as exc:
        # SamplingParams names the parameter first: "top_p must be in (0, 1], got 0".
        name = str(exc).split(" ", 1)[0]
        raise oa.invalid(str(exc), name if name.isidentifier() else None) from None


def _cancel(response: Any) -> None:
    """Cancel a handle call (the replica's engine aborts the request), ignoring how it had ended.

    `DeploymentResponseGenerator.cancel()` re-raises the call's own failure (a `BackPressureError`,
    say) when it never reached a replica; there is nothing left to cancel then.
    """
    with contextlib.suppress(Exception):
        response.cancel()


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _builder(gen: _Generation) -> oa.ResponseBuilder:
    tokenizer = gen.model.tokenizer
    return oa.ResponseBuilder(
        kind=gen.kind,
        response_id=gen.response_id,
        created=gen.created,
        model=gen.model.name,
        prompt_tokens=len(gen.gen.token_ids),
        top_logprobs=gen.top_logprobs,
        decode=lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
    )


def _tenant_json(tenant: Tenant) -> dict[str, Any]:
    return tenant.to_spec().model_dump()


def _replica_error(exc: BaseException) -> oa.ApiError:
    """The OpenAI-shaped error for a failure between the ingress and a replica."""
    if isinstance(exc, oa.ApiError):
        return exc
    if isinstance(exc, BackPressureError):
        wait = str(max(1, round(exc.retry_after_s or 1)))
        return oa.ApiError(
            503,
            "the model is over capacity; retry shortly",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": wait},
        )
    if isinstance(exc, (DeploymentUnavailableError, *_REPLICA_GONE)):
        return oa.ApiError(
            503,
            "the model replica became unavailable",
            type="server_error",
            code="service_unavailable",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, TimeoutError):
        return oa.ApiError(503, "the model replica stopped responding", type="server_error", code="timeout")
    if isinstance(exc, RequestCancelledError | asyncio.CancelledError):
        return oa.ApiError(499, "the request was cancelled", type="server_error", code="cancelled")
    log.error("generation failed: %r", exc)
    return oa.ApiError(500, "the model replica failed", type="server_error", code="internal_error")


def _import_callable(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------------------------- the deployment
# Last in the module on purpose: `serve.ingress` pickles the routes while the class is being
# defined, so every global they use must exist by then.


@serve.ingress(api)
class Ingress:
    """FastAPI routes under Ray Serve; `models` maps each served model name to its deployment handle."""

    async def __init__(self, settings: IngressSettings, models: Mapping[str, Any]) -> None:  # type: ignore[misc]
        self.settings = settings
        self._redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast: the fallbacks above decide what an outage means
        )
        self.tenants = TenantStore(self._redis, settings.key_prefix)
        self.limiter = RateLimiter(self._redis, key_prefix=f"{settings.key_prefix}:ratelimit")
        self.concurrency = ConcurrencyLimiter(self._redis, key_prefix=f"{settings.key_prefix}:concurrency")
        self._auth_cache: collections.OrderedDict[str, tuple[Tenant, float]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._created = int(time.time())
        self._observer = _import_callable(settings.request_observer) if settings.request_observer else None
        self._models = {
            name: _Model(
                name=name,
                handle=handle,
                stream_handle=handle.options(stream=True),
                tokenizer=Tokenizer.from_dir(settings.model_paths[name]),
            )
            for name, handle in models.items()
        }
        if settings.tenants_file:
            await self._load_tenants_file(settings.tenants_file)

    async def _load_tenants_file(self, path: str) -> None:
        """Upsert the file's tenants once per file content, so a restart does not undo admin changes."""
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        marker = f"{{{self.settings.key_prefix}:tenants}}:file:{digest}"
        if not await self._redis.set(marker, "1", nx=True):
            return
        try:
            loaded = await self.tenants.load_yaml(path)
        except BaseException:
            await self._redis.delete(marker)
            raise
        log.info("loaded %d tenants from %s", len(loaded), path)

    # ------------------------------------------------------------------ OpenAI routes

    @api.post("/v1/completions", openapi_extra=_body(oa.CompletionRequest), responses=_ERRORS)
    async def completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "completion")

    @api.post("/v1/chat/completions", openapi_extra=_body(oa.ChatCompletionRequest), responses=_ERRORS)
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "chat")

    @api.get("/v1/models", response_model=oa.ModelList, responses=_ERRORS)
    async def list_models(self, request: Request) -> oa.ModelList:
        tenant = await self._authenticate(request)
        cards = []
        for name, model in self._models.items():
            if tenant.allows_model(name):
                max_len = model.info["max_model_len"] if model.info else None
                cards.append(oa.ModelCard(id=name, created=self._created, max_model_len=max_len))
        return oa.ModelList(data=cards)

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        """Liveness of the ingress; `redis` says whether auth and limits run normally or degraded."""
        try:
            async with asyncio.timeout(self.settings.redis_timeout_s):
                await self._redis.ping()
            redis_state = "ok"
        except _REDIS_ERRORS:
            redis_state = "unavailable"
        status = "ok" if redis_state == "ok" else "degraded"
        return {"status": status, "redis": redis_state, "models": sorted(self._models)}

    # ------------------------------------------------------------------ admin routes

    @api.post("/admin/tenants", status_code=201, openapi_extra=_body(TenantSpec), responses=_ERRORS)
    async def create_tenant(self, request: Request) -> JSONResponse:
        self._require_admin(request)
        spec = oa.parse_request(TenantSpec, await self._read_json(request))
        async with self._admin_errors():
            tenant, api_key = await self.tenants.create(spec)
        return JSONResponse({**_tenant_json(tenant), "api_key": api_key}, status_code=201)

    @api.get("/admin/tenants", responses=_ERRORS)
    async def list_tenants(self, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        async with self._admin_errors():
            tenants = await self.tenants.list()
        return {"object": "list", "data": [_tenant_json(t) for t in tenants]}

    @api.get("/admin/tenants/{tenant_id}", responses=_ERRORS)
    async def get_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        async with self._admin_errors():
            return _tenant_json(await self.tenants.get(tenant_id))

    @api.patch("/admin/tenants/{tenant_id}", openapi_extra=_body(TenantUpdate), responses=_ERRORS)
    async def update_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        update = oa.parse_request(TenantUpdate, await self._read_json(request))
        async with self._admin_errors():
            tenant = await self.tenants.update(tenant_id, update)
        self._forget_tenant(tenant_id)
        return _tenant_json(tenant)

    @api.delete("/admin/tenants/{tenant_id}", responses=_ERRORS)
    async def delete_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        async with self._admin_errors():
            await self.tenants.delete(tenant_id)
        self._forget_tenant(tenant_id)
        return {"id": tenant_id, "object": "tenant", "deleted": True}

    @api.post("/admin/tenants/{tenant_id}/rotate-key", responses=_ERRORS)
    async def rotate_key(self, tenant_id: str, request: Request) -> dict[str, Any]:
        self._require_admin(request)
        async with self._admin_errors():
            api_key = await self.tenants.rotate_key(tenant_id)
        self._forget_tenant(tenant_id)
        return {"id": tenant_id, "api_key": api_key}

    def _require_admin(self, request: Request) -> None:
        expected = self.settings.admin_key
        if expected is None:
            raise oa.ApiError(
                403, "the admin API is disabled: no admin key is configured", type="permission_error"
            )
        given = _bearer(request)
        if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
            raise oa.ApiError(401, "missing or incorrect admin key", code="invalid_api_key")

    @contextlib.asynccontextmanager
    async def _admin_errors(self) -> AsyncIterator[None]:
        try:
            yield
        except TenantNotFound as exc:
            raise oa.ApiError(404, str(exc), param="tenant_id", code="tenant_not_found") from None
        except (TenantExists, ApiKeyConflict) as exc:
            raise oa.ApiError(409, str(exc), code="conflict") from None
        except (TenantError, *_REDIS_ERRORS) as exc:
            raise oa.ApiError(503, f"the tenant store is unavailable: {exc}", type="server_error") from None

    def _forget_tenant(self, tenant_id: str) -> None:
        """Drop this replica's fallback copies of a changed tenant (they must not outlive a rotation)."""
        for key_hash in [h for h, (t, _) in self._auth_cache.items() if t.id == tenant_id]:
            del self._auth_cache[key_hash]

    # ------------------------------------------------------------------ request checks

    async def _authenticate(self, request: Request) -> Tenant:
        """The caller's tenant (algorithm and Redis-down policy in the module docstring)."""
        api_key = _bearer(request)
        if not api_key:
            raise oa.ApiError(
                401, "missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
            )
        key_hash = hash_api_key(api_key)
        try:
            tenant = await self.tenants.authenticate(api_key)
        except _REDIS_ERRORS as exc:
            cached = self._auth_cache.get(key_hash)
            if cached is not None and time.monotonic() - cached[1] <= self.settings.auth_stale_s:
                log.warning("tenant store unavailable (%r); using the last known tenant of a key", exc)
                return cached[0]
            raise oa.ApiError(
                503,
                "authentication is temporarily unavailable",
                type="server_error",
                code="service_unavailable",
            ) from None
        if tenant is None:
            self._auth_cache.pop(key_hash, None)
            raise oa.ApiError(401, "incorrect API key provided", code="invalid_api_key")
        self._auth_cache[key_hash] = (tenant, time.monotonic())
        self._auth_cache.move_to_end(key_hash)
        while len(self._auth_cache) > _AUTH_CACHE_SIZE:
            self._auth_cache.popitem(last=False)
        return tenant

    async def _read_json(self, request: Request) -> Any:
        """The body as JSON, refusing more than `max_body_bytes` before and while reading it."""
        limit = self.settings.max_body_bytes
        too_large = oa.ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise oa.invalid("invalid Content-Length header")
            if int(length) > limit:
                raise too_large
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise too_large
        if not data:
            raise oa.invalid("the request body is empty; send a JSON object")
        try:
            return json.loads(bytes(data), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise oa.invalid(f"the request body is not valid JSON: {_short(exc)}") from None

    def _model_for(self, body: Any, tenant: Tenant) -> _Model:
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise oa.invalid("model: a model name is required", "model")
        model = self._models.get(name)
        if model is None:
            raise oa.ApiError(
                404, f"the model `{name}` does not exist", param="model", code="model_not_found"
            )
        if not tenant.allows_model(name):
            raise oa.ApiError(
                403,
                f"this API key may not use the model `{name}`",
                type="permission_error",
                param="model",
                code="model_not_allowed",
            )
        return model

    async def _model_info(self, model: _Model) -> dict[str, Any]:
        """The model's context length and page size, asked of a replica once."""
        if model.info is None:
            async with model.lock:
                if model.info is None:
                    try:
                        async with asyncio.timeout(self.settings.model_info_timeout_s):
                            model.info = await model.handle.get_model_info.remote()
                    except (TimeoutError, BackPressureError, DeploymentUnavailableError, *_REPLICA_GONE):
                        raise oa.ApiError(
                            503,
                            f"the model `{model.name}` is not ready",
                            type="server_error",
                            code="service_unavailable",
                            headers={"Retry-After": "5"},
                        ) from None
        return model.info

    async def _admit(self, tenant: Tenant, tokens: int) -> _Admission:
        """Charge the tenant's limits (429 when over); on a Redis error admit without limits."""
        limits: list[tuple[str, Limit]] = []
        if tenant.rpm is not None:
            limits.append(("requests", Limit(f"{{{tenant.id}}}:rpm", tenant.rpm, 1)))
        if tenant.tpm is not None:
            if tokens > tenant.tpm:
                raise oa.invalid(
                    f"this request needs {tokens} tokens (prompt + max_tokens) but the key's limit is "
                    f"{tenant.tpm} tokens per minute; lower max_tokens or shorten the prompt",
                    "max_tokens",
                    code="request_exceeds_token_limit",
                )
            limits.append(("tokens", Limit(f"{{{tenant.id}}}:tpm", tenant.tpm, tokens)))
        headers: dict[str, str] = {}
        tpm = next((lim for kind, lim in limits if kind == "tokens"), None)
        try:
            decisions = await self.limiter.check_all([lim for _, lim in limits]) if limits else ()
        except _REDIS_ERRORS as exc:
            log.warning("rate limiter unavailable (%r); admitting tenant %s without limits", exc, tenant.id)
            return _Admission(None, None, None, None, {})
        for (kind, _), decision in zip(limits, decisions, strict=True):
            headers |= _ratelimit_headers(kind, decision)
        if not all(d.allowed for d in decisions):
            wait = retry_after_header(decisions)
            refused = [kind for (kind, _), d in zip(limits, decisions, strict=True) if not d.allowed]
            raise oa.ApiError(
                429,
                f"rate limit reached for {' and '.join(refused)} per minute; retry after {wait} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(wait)},
            )
        admission = _Admission(self.limiter, self.concurrency, tpm, None, headers)
        if tenant.max_concurrency is None:
            return admission
        try:
            admission.lease = await self.concurrency.acquire(f"{{{tenant.id}}}:conc", tenant.max_concurrency)
        except _REDIS_ERRORS as exc:
            log.warning("concurrency limiter unavailable (%r); admitting tenant %s", exc, tenant.id)
            return admission
        if admission.lease is None:
            await self._refund(limits)
            raise oa.ApiError(
                429,
                f"too many concurrent requests (the limit is {tenant.max_concurrency})",
                type="rate_limit_error",
                code="concurrency_limit_exceeded",
                headers={**headers, "Retry-After": "1"},
            )
        admission.renewer = asyncio.get_running_loop().create_task(
            _renew_lease(self.concurrency, admission.lease)
        )
        return admission

    async def _refund(self, limits: list[tuple[str, Limit]]) -> None:
        """Undo a charge for a request that was refused after all (a full concurrency limit)."""
        for _, lim in limits:
            with contextlib.suppress(*_REDIS_ERRORS):
                await self.limiter.refund(lim.key, lim.rate_per_min, lim.cost, lim.burst)

    # ------------------------------------------------------------------ generation

    async def _serve_generation(self, request: Request, kind: oa.Kind) -> Response:
        started = time.monotonic()
        endpoint = request.url.path
        tenant: Tenant | None = None
        model_name: str | None = None
        stream = False
        try:
            tenant = await self._authenticate(request)
            raw = await self._read_json(request)
            model = self._model_for(raw, tenant)
            model_name = model.name
            stream = bool(raw.get("stream")) if isinstance(raw, dict) else False
            req_cls = oa.CompletionRequest if kind == "completion" else oa.ChatCompletionRequest
            body = oa.parse_request(req_cls, raw)
            gen = await self._prepare(kind, model, tenant, body, started)
            admission = await self._admit(tenant, len(gen.gen.token_ids) + gen.gen.params.max_tokens)
        except oa.ApiError as err:
            self._observe(
                RequestRecord(
                    tenant.id if tenant else None,
                    model_name,
                    endpoint,
                    err.status,
                    stream,
                    duration_s=time.monotonic() - started,
                    error_type=err.type,
                )
            )
            raise
        try:
            first, response = await self._open_stream(gen)
        except BaseException as exc:
            admission.settle(0, self._tasks)
            if isinstance(exc, oa.ApiError):
                exc.headers = {**admission.headers, **exc.headers}
                self._observe(self._record(gen, endpoint, None, exc.status, exc.type))
            raise
        record = partial(self._record, gen, endpoint, time.monotonic() - started)
        finisher = _Finisher(_builder(gen), response, admission, self._tasks, record, self._observe)
        if gen.body.stream:
            headers = {**admission.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            events = self._sse(gen, first, response, finisher)
            return _SSEResponse(events, finisher.abandon, media_type="text/event-stream", headers=headers)
        return await self._complete(first, response, finisher)

    async def _prepare(
        self, kind: oa.Kind, model: _Model, tenant: Tenant, body: Any, started: float
    ) -> _Generation:
        """Tokenize, check the context, build the sampling parameters and the block hashes."""
        info = await self._model_info(model)
        max_len, page_size, vocab = info["max_model_len"], info["page_size"], info["vocab_size"]
        namespace = f"{model.name}:{tenant.cache_namespace}"
        messages = body.template_messages() if kind == "chat" else None
        prompt_param = "messages" if kind == "chat" else "prompt"

        def tokenize() -> tuple[str, list[int], list[int]]:
            # Off the event loop: long prompts take real time to tokenize and hash.
            if messages is not None:
                try:
                    text = model.tokenizer.apply_chat_template(messages)
                except Exception as exc:  # the template refuses e.g. an unsupported role order
                    raise oa.invalid(f"messages: {exc}", "messages") from None
                ids = model.tokenizer.encode(text)
            elif isinstance(body.prompt, str):
                text, ids = body.prompt, model.tokenizer.encode(body.prompt)
            else:
                ids = list(body.prompt)
                bad = [t for t in ids if t >= vocab]
                if bad:
                    raise oa.invalid(
                        f"prompt: token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt"
                    )
                text = model.tokenizer.decode(ids, skip_special_tokens=False)
            if len(ids) >= max_len:
                raise _context_error(max_len, len(ids), None, prompt_param)
            return text, ids, block_hashes(ids, page_size, namespace)

        text, token_ids, hashes = await asyncio.to_thread(tokenize)
        room = max_len - len(token_ids)
        if kind == "chat":
            requested = body.output_limit
            max_tokens = requested if requested is not None else min(self.settings.default_max_tokens, room)
            top = (body.top_logprobs or 0) if body.logprobs else None
        else:
            requested = body.max_tokens
            max_tokens = requested if requested is not None else min(_COMPLETION_DEFAULT_MAX_TOKENS, room)
            top = body.logprobs
        if max_tokens > room:
            param = "max_completion_tokens" if kind == "chat" and body.max_completion_tokens else "max_tokens"
            raise _context_error(max_len, len(token_ids), max_tokens, param)
        params = _sampling_params(body, max_tokens, top)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        gen = GenerateRequest(
            request_id=response_id,
            token_ids=token_ids,
            params=params,
            namespace=namespace,
            priority=tenant.priority,
            block_hashes=hashes,
            prompt=text,
            chat_messages=messages,
            tenant_id=tenant.id,
        )
        return _Generation(kind, model, tenant, body, gen, response_id, int(time.time()), started, top)

    async def _open_stream(self, gen: _Generation) -> tuple[dict[str, Any], Any]:
        """Start the generation and wait for its first item; retry replicas that die before it."""
        attempts = self.settings.max_retries + 1
        for attempt in range(attempts):
            response = None
            try:
                # Backpressure (a full queue) can surface from `.remote()` itself or from the first item.
                response = gen.model.stream_handle.generate.remote(gen.gen)
                first = await self._next(response)
            except BaseException as exc:
                if response is not None:
                    _cancel(response)
                if not isinstance(exc, Exception):  # cancelled: the client is gone
                    raise
                if isinstance(exc, _REPLICA_GONE) and attempt + 1 < attempts:
                    log.warning("replica failed before the first token of %s; retrying", gen.response_id)
                    continue
                raise _replica_error(exc) from None
            if first is None:
                raise oa.ApiError(500, "the model replica returned no output", type="server_error")
            if "error" in first:
                _cancel(response)
                detail = first["error"]
                raise oa.ApiError(
                    first.get("status", 500),
                    detail["message"],
                    type=detail["type"],
                    param=detail.get("param"),
                    code=detail.get("code"),
                )
            return first, response
        raise AssertionError("unreachable")

    async def _next(self, response: Any) -> dict[str, Any] | None:
        """The next item of a replica stream, None at its end; a silent replica times out."""
        try:
            async with asyncio.timeout(self.settings.stream_idle_timeout_s):
                return await response.__anext__()
        except StopAsyncIteration:
            return None

    async def _items(self, first: dict[str, Any], response: Any) -> AsyncIterator[dict[str, Any]]:
        item: dict[str, Any] | None = first
        while item is not None:
            if "error" in item:
                raise oa.ApiError(
                    item.get("status", 500), item["error"]["message"], type=item["error"]["type"]
                )
            yield item
            if item.get("finish_reason") is not None:
                return
            item = await self._next(response)
        raise oa.ApiError(500, "the model replica ended the stream without finishing", type="server_error")

    async def _complete(self, first: dict[str, Any], response: Any, finisher: _Finisher) -> JSONResponse:
        """A non-streaming answer: gather every delta, then one response body."""
        acc = finisher.acc
        try:
            async for item in self._items(first, response):
                acc.add(item)
        except Exception as exc:
            error = _replica_error(exc)
            finisher.finish(error.status, error.type)
            raise error from None
        except BaseException:
            finisher.finish(499)  # the client went away (nginx's convention; for metrics only)
            raise
        finisher.finish(200)
        return JSONResponse(acc.response().model_dump(), headers=finisher.admission.headers)

    async def _sse(
        self, gen: _Generation, first: dict[str, Any], response: Any, finisher: _Finisher
    ) -> AsyncIterator[str]:
        """SSE events: one chunk per delta, a usage chunk if asked, `[DONE]`; a failure is an error event."""
        acc = finisher.acc
        try:
            if gen.kind == "chat":
                yield _sse_event(acc.role_chunk())
            async for item in self._items(first, response):
                yield _sse_event(acc.chunk(item, acc.add(item)))
            if gen.body.include_usage:
                yield _sse_event(acc.usage_chunk())
            finisher.finish(200)
            yield "data: [DONE]\n\n"
        except Exception as exc:
            # The 200 and its headers are sent already: the error travels in the stream, which still ends.
            err = _replica_error(exc)
            log.warning("stream %s failed: %s", gen.response_id, err.message)
            finisher.finish(err.status, err.type)
            yield _sse_event(err.body())
            yield "data: [DONE]\n\n"
        finally:
            finisher.abandon()  # cancelled or closed early: no-op if finished above

    # ------------------------------------------------------------------ observation

    def _record(
        self,
        gen: _Generation,
        endpoint: str,
        ttft: float | None,
        status: int,
        error_type: str | None = None,
        acc: oa.ResponseBuilder | None = None,
    ) -> RequestRecord:
        return RequestRecord(
            tenant_id=gen.tenant.id,
            model=gen.model.name,
            endpoint=endpoint,
            status=status,
            stream=bool(gen.body.stream),
            prompt_tokens=len(gen.gen.token_ids),
            cached_tokens=acc.cached_tokens if acc else 0,
            completion_tokens=acc.completion_tokens if acc else 0,
            ttft_s=ttft,
            duration_s=time.monotonic() - gen.started,
            error_type=error_type,
        )

    def _observe(self, record: RequestRecord) -> None:
        if self._observer is None:
            return
        try:
            self._observer(record)
        except Exception:  # metrics must never fail a request
            log.exception("request observer failed")
