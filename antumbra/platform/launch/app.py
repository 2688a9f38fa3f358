"""The Ray Serve application: one ingress deployment in front of one model deployment per model.

`build_app(PlatformConfig(...))` returns an `Application` for `serve.run`. A Serve config file
uses the builder instead (Serve passes the `args:` mapping to it):

    applications:
      - name: antumbra
        route_prefix: /
        import_path: antumbra.platform.launch.app:app_builder
        args:
          config: /etc/antumbra/platform.yaml    # optional; the keys below override it
          redis_url: redis://redis:6379/0        # default: $ANTUMBRA_REDIS_URL
          directory_redis_urls: [redis://dir-0:6379/0, redis://dir-1:6379/0]  # optional: a sharded
                                                 # prefix directory (default: it lives in redis_url)
          models:
            deepseek-v4: {path: /models/dsv4, replicas: 2, device: cuda, dtype: bfloat16, num_gpus: 1}
            deepseek-v4-flash: {path: /models/flash, device: cuda, dtype: bfloat16,
                                tensor_parallel_size: 2, expert_parallel_size: 2}  # 4 GPUs a replica

The same mapping (YAML or JSON) is what `PlatformConfig.from_file` and `antumbra serve --config`
read. Each model may name a request router class (`router: "module:Class"`; default: Antumbra's
cache-affinity router, `null` for Ray Serve's power of two choices) and an autoscaling policy
(`autoscaling: {policy: combined, max_replicas: 4}`, policies from
`antumbra.platform.control.autoscaling`). `disaggregation: {prefill_replicas: 2, decode_replicas: 4}`
splits a model into prefill and decode deployments (`platform/replica/disaggregated.py`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from antumbra import env
from antumbra.platform.ingress.deployment import Ingress
from antumbra.platform.launch.platform_config import (
    DEFAULT_PUBLISHER,
    DisaggregationSpec,
    ModelSpec,
    PlatformConfig,
    model_deployment_name,
    read_config_file,
)
from antumbra.platform.replica.model_server import ModelServer

log = logging.getLogger(__name__)

INGRESS_DEPLOYMENT = "Ingress"
# How often a draining replica counts its ongoing requests (Serve's default: every 2 s). A replica
# stops at the first count that finds none, so an idle one being scaled down, replaced or shut down
# frees its GPU within this interval instead of Serve's; the count is a local read, cheap at any rate.
DRAIN_POLL_S = 0.25


# ---------------------------------------------------------------------------------------------- building


class StartHook:
    """Runs in each model replica once its engine is loaded: `target(engine, replica_id, model, redis_url)`.

    A missing module is tolerated only for the default publisher (the platform then serves
    without directory updates); a hook someone configured must import.
    """

    def __init__(
        self, target: str, model_name: str, redis_url: str, directory_urls: tuple[str, ...] = ()
    ) -> None:
        self.target = target
        self.model_name = model_name
        self.redis_url = redis_url
        self.directory_urls = directory_urls  # a sharded directory: passed as `directory_urls=`

    def __call__(self, engine: Any, replica_id: str) -> Any:
        module_name, _, fn_name = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if self.target == DEFAULT_PUBLISHER and exc.name == module_name:
                log.info("no %s module: replica %s publishes no cache events", module_name, replica_id)
                return None
            raise
        sharded = {"directory_urls": self.directory_urls} if self.directory_urls else {}
        return getattr(module, fn_name)(engine, replica_id, self.model_name, self.redis_url, **sharded)


def build_app(config: PlatformConfig) -> Application:
    """The application: `Ingress` bound to one `ModelServer` deployment per model."""
    models = {spec.name: _model_deployment(spec, config) for spec in config.models}
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=config.ingress_replicas,
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        ray_actor_options={"num_cpus": 0, **_custom(config.ingress_resources)},
    )(Ingress)
    return ingress.bind(config.ingress_settings(), models)


def _custom(resources: Any) -> dict[str, Any]:
    return {"resources": {k: float(v) for k, v in resources.items()}} if resources else {}


def _model_deployment(spec: ModelSpec, config: PlatformConfig) -> Application:
    options: dict[str, Any] = {
        "name": model_deployment_name(spec.name),
        "max_ongoing_requests": spec.max_ongoing_requests,
        "max_queued_requests": spec.max_queued_requests,
        **spec.replica_placement(),
        "health_check_period_s": spec.health_check_period_s,
        "health_check_timeout_s": spec.health_check_timeout_s,
        "graceful_shutdown_timeout_s": spec.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "request_router_config": _router_config(spec, config),
    }
    if spec.autoscaling is not None:
        options["autoscaling_config"] = spec.autoscaling.to_ray()
    else:
        options["num_replicas"] = spec.replicas
    hook = (StartHook(config.publisher, spec.name, config.redis_url, config.directory_redis_urls)
            if config.publisher else None)
    args = (spec.name, spec.path, spec.device, spec.dtype)
    if spec.disaggregation is not None:
        return disaggregated_deployments(spec, spec.disaggregation, options, args, hook)
    deployment = serve.deployment(**options)(ModelServer)
    return deployment.bind(*args, **spec.replica_kwargs(), on_start=hook)


def disaggregated_deployments(spec: ModelSpec, split: DisaggregationSpec, options: dict[str, Any],
                              args: tuple[str, ...], hook: StartHook | None) -> Application:
    """The decode deployment (under the model's deployment name, so the ingress streams from it), bound
    to a prefill deployment `<name>-prefill`; both routed by cache affinity, both publishing."""
    from antumbra.platform.replica.disaggregated import DecodeServer, PrefillServer

    kwargs = {**spec.replica_kwargs(), "on_start": hook}
    prefill = serve.deployment(**{**options, "name": options["name"] + "-prefill",
                                  "num_replicas": split.prefill_replicas})(PrefillServer)
    prefill_app = prefill.bind(*args, **kwargs, cp_ranks=split.cp_ranks,
                               cp_threshold_tokens=split.cp_threshold_tokens)
    decode = serve.deployment(**{**options, "num_replicas": split.decode_replicas})(DecodeServer)
    return decode.bind(*args, **kwargs, prefill=prefill_app, prefill_retry_s=split.prefill_retry_s)


def _router_config(spec: ModelSpec, config: PlatformConfig) -> RequestRouterConfig:
    """The router (Ray's default unless named), polling replica stats every `routing_stats_period_s`.

    A named router gets `model_name`, `redis_url`, `key_prefix`, `page_size` (and
    `directory_redis_urls` for a sharded directory) as
    `request_router_kwargs` when its `initialize_state` names them, then the configured
    `router_kwargs`.
    """
    fields: dict[str, Any] = {"request_routing_stats_period_s": spec.routing_stats_period_s}
    if spec.router is not None:
        router_cls = _import(spec.router)
        offered: dict[str, Any] = {
            "model_name": spec.name,
            "redis_url": config.redis_url,
            "key_prefix": config.key_prefix,
        }
        if config.directory_redis_urls:
            offered["directory_redis_urls"] = config.directory_redis_urls
        page_size = _page_size(spec.path)
        if page_size is not None:
            offered["page_size"] = page_size
        params = inspect.signature(router_cls.initialize_state).parameters
        fields["request_router_class"] = spec.router
        fields["request_router_kwargs"] = {k: v for k, v in offered.items() if k in params} | dict(
            spec.router_kwargs
        )
    return RequestRouterConfig(**fields)


def _page_size(path: str) -> int | None:
    """The model's cache page size (block hashes in the directory are per page); None when the
    checkpoint is not readable here (the replicas report the error when they load it)."""
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.checkpoint_files import load_hf_config

    try:
        return ModelConfig.from_hf(load_hf_config(path)).page_size
    except (FileNotFoundError, ValueError):
        return None


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config entry point, `import_path: antumbra.platform.launch.app:app_builder` (module docstring).

    `args` may name a `config` file; its other keys override the file's. `redis_url` and
    `admin_key` default to `$ANTUMBRA_REDIS_URL` and `$ANTUMBRA_ADMIN_KEY`. With no models, the
    tiny generated checkpoint is served as `antumbra-tiny`.
    """
    args = dict(args or {})
    path = args.pop("config", None)
    data = {**(read_config_file(path) if path else {}), **args}
    data.setdefault("redis_url", env.redis_url())
    data.setdefault("admin_key", env.admin_key())
    if not data.get("models"):
        from antumbra.platform.launch.tiny_model import default_tiny_model_dir

        data["models"] = {"antumbra-tiny": {"path": str(default_tiny_model_dir())}}
    return build_app(PlatformConfig.from_dict(data))


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    if not name:
        module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
