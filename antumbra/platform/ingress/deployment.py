"""The ingress deployment: OpenAI-compatible REST in front of the model deployments.

Per generation request, in this order (each step answers in OpenAI's error shape, `errors`):

  1. auth: `Authorization: Bearer <key>` → tenant (401 missing or unknown key; `auth`);
  2. body: read at most `max_body_bytes` (413, from Content-Length and while reading), JSON (400;
     `request_body`);
  3. model: known (404) and allowed for the tenant (403; `served_model`); a free slot of its
     capacity, this ingress's share of the running replicas' slots or one other ingresses leave
     idle (else a 503 at once, before any costly step or limit, with a spread retry wait;
     `capacity`, `shared_slots`);
  4. parameters: validated with the OpenAI field names (400 naming `param`); unsupported options 400;
  5. tokenize (chat template for chat) and check the context (400 `context_length_exceeded`; `prepare`);
  6. limits: GCRA requests/min and tokens/min (tokens charged as prompt + max_tokens, corrected to
     the real count at the end) and max concurrency (429 with `Retry-After`, `x-ratelimit-*`;
     `admission`);
  7. block hashes of the prompt in the cache namespace `f"{model}:{tenant.cache_namespace}"`, the
     same string the engine gets as `namespace`, so engine cache and prefix directory agree (`prepare`);
  8. the model deployment, through a streaming handle (the request router reads the hashes);
     over Ray's queue (`max_queued_requests`) a 503; a replica that dies before the first token
     is retried on another replica (`max_retries`); after it a stream ends with an SSE error
     event and `[DONE]`, while a non-streaming request (the client has seen nothing) starts over
     on another replica, up to `max_retries` times (then 503); never a hang
     (`stream_idle_timeout_s`; `replica_stream`, `streaming`, `generation`).

A client disconnect cancels the handler; the handle call is cancelled with it and the replica's
engine aborts the request. Each request that reached a replica is metered once, however it ended
(`usage`; read back by `GET /admin/usage`, `usage_query`).

Redis down (documented choice): keys seen recently still authenticate and unknown ones get 503
(`auth`); rate and concurrency limits fail open (`admission`); usage waits in a bounded queue
(`usage_meter`); `/health` says so (`redis_health`).
"""

# No `from __future__ import annotations` here: FastAPI must resolve `Request` in the route
# signatures that Ray Serve rewrites for class-based views, outside this module's globals.
import asyncio
import logging
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from antumbra.platform.ingress.admin import (
    WeightsBody,
    admin_errors,
    each_replica,
    served_or_404,
    tenant_json,
)
from antumbra.platform.ingress.admission import Admission, Admitter
from antumbra.platform.ingress.auth import Authenticator, require_admin
from antumbra.platform.ingress.capacity import over_capacity, start_watch
from antumbra.platform.ingress.errors import add_error_handlers
from antumbra.platform.ingress.generation import (
    Finisher,
    Generation,
    complete,
    generation_record,
    response_builder,
    usage_record,
)
from antumbra.platform.ingress.loop_lag import GcPauses, LoopLag
from antumbra.platform.ingress.observation import RequestObserver, RequestRecord
from antumbra.platform.ingress.openai_errors import ApiError, invalid
from antumbra.platform.ingress.openai_requests import (
    REQUEST_MODELS,
    ChatCompletionRequest,
    CompletionRequest,
    Kind,
    parse_request,
)
from antumbra.platform.ingress.openai_responses import ModelCard, ModelList
from antumbra.platform.ingress.openapi import ERROR_RESPONSES, json_body, openapi_schema
from antumbra.platform.ingress.prepare import prepare
from antumbra.platform.ingress.ratelimit import ConcurrencyLimiter, RateLimiter
from antumbra.platform.ingress.redis_health import RedisHealth
from antumbra.platform.ingress.replica_admin import slo_reports
from antumbra.platform.ingress.replica_stream import Retries, open_stream
from antumbra.platform.ingress.request_body import read_json
from antumbra.platform.ingress.served_model import ServedModel, model_for
from antumbra.platform.ingress.shared_slots import SharedSlots
from antumbra.platform.ingress.streaming import sse_response
from antumbra.platform.ingress.tenant_spec import Tenant, TenantSpec, TenantUpdate
from antumbra.platform.ingress.tenants import TenantStore
from antumbra.platform.ingress.usage_meter import UsageMeter
from antumbra.platform.ingress.usage_query import UsageWindow, query_usage
from antumbra.platform.messages import Delta, ReplicaQuery, WeightsUpdate
from antumbra.platform.redis_client import redis_client

log = logging.getLogger(__name__)

USAGE_FLUSH_S = 10.0  # how long a replica that shuts down keeps trying to write queued usage


@dataclass(frozen=True)
class IngressSettings:
    """What one ingress replica needs; `launch.app` derives it from `PlatformConfig`."""

    redis_url: str
    model_paths: Mapping[str, str]  # served model name -> checkpoint directory (for its tokenizer)
    model_thinking_default: Mapping[str, bool] = field(default_factory=dict)  # chat thinking when unasked
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
    # The capacity gate (capacity.py): each model's deployment and max_ongoing_requests; empty: off.
    model_deployments: Mapping[str, str] = field(default_factory=dict)
    model_max_ongoing: Mapping[str, int] = field(default_factory=dict)
    capacity_refresh_s: float = 1.0
    redis_owner: str = "external"  # "platform": the launcher started this Redis and restarts it
    redis_check_s: float = 1.0  # how often the ingress pings Redis for `/health` and auth
    # Every chunk crosses from Ray's threads to the event loop; while a worker thread runs Python
    # (tokenizing, hashing), each such hand-off can wait out the whole interval. None: Python's.
    gil_switch_interval_s: float | None = None


# --------------------------------------------------------------------------------------------- FastAPI app

api = FastAPI(title="Antumbra", version="0.1.0", description="OpenAI-compatible multi-tenant LLM serving")
add_error_handlers(api)


def _openapi() -> dict[str, Any]:
    return openapi_schema(api, (*REQUEST_MODELS, TenantSpec, TenantUpdate))


api.openapi = _openapi  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------- the deployment
# Last in the module on purpose: `serve.ingress` pickles the routes while the class is being
# defined, so every global they use must exist by then.


@serve.ingress(api)
class Ingress:
    """FastAPI routes under Ray Serve; `models` maps each served model name to its deployment handle."""

    async def __init__(  # type: ignore[misc]
        self, settings: IngressSettings, models: Mapping[str, Any]
    ) -> None:
        self.settings = settings
        # Fail fast: `auth` and `admission` decide what an outage means.
        self._redis = redis_client(settings.redis_url, timeout_s=settings.redis_timeout_s)
        self.tenants = TenantStore(self._redis, settings.key_prefix)
        self.redis_health = RedisHealth(settings.redis_owner)
        self.auth = Authenticator(self.tenants, settings.auth_stale_s, health=self.redis_health)
        self.meter = UsageMeter(self._redis, settings.key_prefix)
        self.meter.start()  # sweeps the open usage entries of dead ingresses
        self.admitter = Admitter(
            RateLimiter(self._redis, key_prefix=f"{settings.key_prefix}:ratelimit"),
            ConcurrencyLimiter(self._redis, key_prefix=f"{settings.key_prefix}:concurrency"),
        )
        self._tasks: set[asyncio.Task] = set()
        self._watch = asyncio.get_running_loop().create_task(
            self.redis_health.watch(self._redis, settings.redis_check_s, settings.redis_timeout_s))
        self._created = int(time.time())
        self._observe = RequestObserver(settings.request_observer)
        self._models = {
            name: ServedModel.of(name, handle, settings.model_paths[name],
                                 settings.model_thinking_default.get(name, False))
            for name, handle in models.items()
        }
        if settings.tenants_file and (loaded := await self.tenants.load_yaml_once(settings.tenants_file)):
            log.info("loaded %d tenants from %s", len(loaded), settings.tenants_file)
        self._shared: SharedSlots | None = None
        if settings.model_max_ongoing:
            self._shared, self._capacity_task = start_watch(
                {n: m.slots for n, m in self._models.items()}, settings.model_deployments,
                settings.model_max_ongoing, self._redis, settings.key_prefix, settings.capacity_refresh_s)
        if settings.gil_switch_interval_s is not None:  # why: `IngressSettings`
            sys.setswitchinterval(settings.gil_switch_interval_s)
        self.loop_lag, self.gc_pauses = LoopLag(), GcPauses.installed()
        self._lag_task = asyncio.get_running_loop().create_task(self.loop_lag.run())

    async def __del__(self) -> None:
        """Serve's graceful shutdown: write the usage still queued (if `__init__` got that far)."""
        if (meter := getattr(self, "meter", None)) is not None:
            await meter.close(USAGE_FLUSH_S)

    def take_loop_lags(self) -> dict[str, Any]:
        """This replica's id, its event loop's lags and its garbage collections' pauses (seconds)
        since the last call, and its GIL switch interval (`loop_lag`)."""
        replica_id = serve.get_replica_context().replica_id.unique_id
        return {"replica_id": replica_id, "lags_s": self.loop_lag.take(), "gc_pauses": self.gc_pauses.take(),
                "gil_switch_interval_us": sys.getswitchinterval() * 1e6}

    # ------------------------------------------------------------------ OpenAI routes

    @api.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=ERROR_RESPONSES)
    async def completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "completion")

    @api.post(
        "/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=ERROR_RESPONSES
    )
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve_generation(request, "chat")

    @api.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(self, request: Request) -> ModelList:
        tenant = await self.auth.authenticate(request)
        cards = []
        for name, model in self._models.items():
            if tenant.allows_model(name):
                max_len = model.info["max_model_len"] if model.info else None
                cards.append(ModelCard(id=name, created=self._created, max_model_len=max_len))
        return ModelList(data=cards)

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        """Liveness of the ingress; `redis` says whether auth, limits and metering run normally or
        degraded (known keys only, limits open, usage queued), and who restarts Redis."""
        up = await self.redis_health.check(self._redis, self.settings.redis_timeout_s)
        return {"status": "ok" if up else "degraded", **self.redis_health.state(),
                "usage_pending": self.meter.pending, "usage_dropped": self.meter.dropped,
                "models": sorted(self._models)}

    # ------------------------------------------------------------------ admin routes

    @api.post(
        "/admin/tenants", status_code=201, openapi_extra=json_body(TenantSpec), responses=ERROR_RESPONSES
    )
    async def create_tenant(self, request: Request) -> JSONResponse:
        require_admin(request, self.settings.admin_key)
        spec = parse_request(TenantSpec, await read_json(request, self.settings.max_body_bytes))
        async with admin_errors():
            tenant, api_key = await self.tenants.create(spec)
        return JSONResponse({**tenant_json(tenant), "api_key": api_key}, status_code=201)

    @api.post(
        "/admin/models/{model}/weights", openapi_extra=json_body(WeightsBody), responses=ERROR_RESPONSES
    )
    async def update_weights(self, model: str, request: Request) -> dict[str, Any]:
        """Load new weights into every replica of `model` without restarting them (RL weight sync)."""
        require_admin(request, self.settings.admin_key)
        body = parse_request(WeightsBody, await read_json(request, self.settings.max_body_bytes))
        served = served_or_404(self._models, model)

        async def update(updated: frozenset[str]) -> dict[str, Any]:
            answer = await served.handle.update_weights.remote(
                WeightsUpdate(body.path, body.version, updated))
            if "error" in answer:
                raise invalid(f"path: {answer['error']}", "path")
            return dict(answer)

        replicas = await each_replica(update)
        return {"object": "model.weights", "model": model, "version": body.version,
                "replicas": sorted(replicas)}

    @api.get("/admin/models/{model}/replicas", responses=ERROR_RESPONSES)
    async def replica_states(
        self, model: str, request: Request, check_integrity: bool = False
    ) -> dict[str, Any]:
        """Each live replica of `model`: id, pid, RSS and engine stats (and invariant checks if asked),
        and this ingress's capacity gate for it."""
        require_admin(request, self.settings.admin_key)
        served = served_or_404(self._models, model)
        states = await each_replica(lambda answered: served.handle.replica_state.remote(
            ReplicaQuery(answered, check_integrity)))
        gate = {"capacity": served.slots.capacity, "in_flight": served.slots.in_flight}
        data = [states[k] for k in sorted(states)]
        return {"object": "list", "model": model, "ingress": gate, "data": data}

    @api.get("/admin/usage", responses=ERROR_RESPONSES)
    async def usage(self, request: Request, tenant: str | None = None,
                    start: str | None = Query(None, alias="from"),
                    end: str | None = Query(None, alias="to")) -> dict[str, Any]:
        """Durable token counts per tenant, model and hour (`usage_query`): `?tenant=&from=&to=`, times
        in ISO 8601 or Unix seconds."""
        require_admin(request, self.settings.admin_key)
        window = UsageWindow.parse(start, end)
        async with admin_errors("the usage store"):
            return await query_usage(self._redis, self.meter.keys, tenant or None, window)

    @api.get("/admin/slo", responses=ERROR_RESPONSES)
    async def slo_attainment(self, request: Request, tenant: str | None = None) -> dict[str, Any]:
        """SLO attainment per tenant and model, added up over every live replica (`replica/slo.py`)."""
        require_admin(request, self.settings.admin_key)
        return {"object": "list", "data": await slo_reports(self._models, tenant)}

    @api.get("/admin/tenants", responses=ERROR_RESPONSES)
    async def list_tenants(self, request: Request) -> dict[str, Any]:
        require_admin(request, self.settings.admin_key)
        async with admin_errors():
            tenants = await self.tenants.list()
        return {"object": "list", "data": [tenant_json(t) for t in tenants]}

    @api.get("/admin/tenants/{tenant_id}", responses=ERROR_RESPONSES)
    async def get_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        require_admin(request, self.settings.admin_key)
        async with admin_errors():
            return tenant_json(await self.tenants.get(tenant_id))

    @api.patch("/admin/tenants/{tenant_id}", openapi_extra=json_body(TenantUpdate), responses=ERROR_RESPONSES)
    async def update_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        require_admin(request, self.settings.admin_key)
        update = parse_request(TenantUpdate, await read_json(request, self.settings.max_body_bytes))
        async with admin_errors():
            tenant = await self.tenants.update(tenant_id, update)
        self.auth.forget(tenant_id)
        return tenant_json(tenant)

    @api.delete("/admin/tenants/{tenant_id}", responses=ERROR_RESPONSES)
    async def delete_tenant(self, tenant_id: str, request: Request) -> dict[str, Any]:
        require_admin(request, self.settings.admin_key)
        async with admin_errors():
            await self.tenants.delete(tenant_id)
        self.auth.forget(tenant_id)
        return {"id": tenant_id, "object": "tenant", "deleted": True}

    @api.post("/admin/tenants/{tenant_id}/rotate-key", responses=ERROR_RESPONSES)
    async def rotate_key(self, tenant_id: str, request: Request) -> dict[str, Any]:
        require_admin(request, self.settings.admin_key)
        async with admin_errors():
            api_key = await self.tenants.rotate_key(tenant_id)
        self.auth.forget(tenant_id)
        return {"id": tenant_id, "api_key": api_key}

    # ------------------------------------------------------------------ generation

    async def _serve_generation(self, request: Request, kind: Kind) -> Response:
        started = time.monotonic()
        endpoint = request.url.path
        gen, admission = await self._admitted(request, kind, started, endpoint)
        settings = self.settings
        retries = Retries()
        try:
            first, response = await open_stream(gen.model.stream_handle, gen.gen, retries=retries,
                                                attempts=settings.max_retries + 1,
                                                idle_timeout_s=settings.stream_idle_timeout_s)
        except BaseException as exc:
            admission.settle(0, self._tasks)
            if isinstance(exc, ApiError):
                exc.headers = {**admission.headers, **retries.header(), **exc.headers}
                self._observe(generation_record(gen, endpoint, None, exc.status, exc.type))
            raise
        record = partial(generation_record, gen, endpoint, time.monotonic() - started)
        meter = self.meter.request(partial(usage_record, gen))
        finisher = Finisher(response_builder(gen), response, admission, self._tasks, record, self._observe,
                            retries, meter)
        if gen.body.stream:
            return sse_response(gen, first, response, finisher, settings.stream_idle_timeout_s)

        async def reopen() -> tuple[Delta, Any]:
            again = await open_stream(gen.model.stream_handle, gen.gen, attempts=settings.max_retries + 1,
                                      idle_timeout_s=settings.stream_idle_timeout_s, retries=retries)
            finisher.restart(response_builder(gen), again[1])
            return again

        return await complete(
            first, response, finisher, settings.stream_idle_timeout_s, reopen, settings.max_retries, gen.gen.n
        )

    async def _admitted(
        self, request: Request, kind: Kind, started: float, endpoint: str
    ) -> tuple[Generation, Admission]:
        """Steps 1-7 of the module docstring; a refusal is reported to the observer, then raised."""
        tenant: Tenant | None = None
        model_name: str | None = None
        stream = False
        try:
            tenant = await self.auth.authenticate(request)
            raw = await read_json(request, self.settings.max_body_bytes)
            model = model_for(raw, tenant, self._models)
            model_name = model.name
            stream = bool(raw.get("stream")) if isinstance(raw, dict) else False
            if not await model.slots.take_or_borrow(model.name, self._shared):  # first (capacity.py)
                raise over_capacity(model.name, model.retry_hint)
            try:
                req_cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
                body = parse_request(req_cls, raw)
                info = await model.model_info(self.settings.model_info_timeout_s)
                limit = self.settings.default_max_tokens
                gen = await prepare(kind, model, tenant, body, info, limit, started)
                tokens = len(gen.gen.token_ids) + gen.gen.n * gen.gen.params.max_tokens
                admission = await self.admitter.admit(tenant, tokens)
            except BaseException:
                model.slots.release()
                raise
            admission.on_settle = model.slots.release
        except ApiError as err:
            self._observe(RequestRecord(tenant.id if tenant else None, model_name, endpoint, err.status,
                                        stream, duration_s=time.monotonic() - started, error_type=err.type))
            raise
        return gen, admission
