"""The platform's configuration: the model specs and `PlatformConfig`, read from a mapping or a
YAML / JSON file with errors that name the place and the bad keys (`app.py` builds the Serve
application from it)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from antumbra import env
from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig
from antumbra.platform.ingress.deployment import IngressSettings
from antumbra.platform.launch.serve_env import DEFAULT_SERVE_LOOPS, serve_loop_env
from antumbra.replicas.scheduling_policy import POLICIES

DEFAULT_PUBLISHER = "antumbra.platform.replica.publisher:attach"
# A replica's GIL switch interval (`ModelSpec.gil_switch_interval_us`; why this value: docs/performance.md).
DEFAULT_GIL_SWITCH_INTERVAL_US = 50.0


@dataclass(frozen=True)
class AutoscalingSpec:
    """Ray Serve autoscaling driven by one of our policies (`control.autoscaling.AUTOSCALING_POLICIES`)."""

    policy: str = "combined"
    min_replicas: int = 1
    max_replicas: int = 2
    initial_replicas: int | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    # How often replicas and handles push load to the controller; None keeps Ray's 10 s. Ray 2.60
    # marks the field deprecated but it is still the only knob its replicas and routers read.
    metrics_interval_s: float | None = None
    policy_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_ray(self) -> dict[str, Any]:
        from antumbra.platform.control.autoscaling import ray_autoscaling_policy

        config: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": ray_autoscaling_policy(self.policy, **dict(self.policy_kwargs)),
        }
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        if self.metrics_interval_s is not None:
            config["metrics_interval_s"] = self.metrics_interval_s
        return config


@dataclass(frozen=True)
class DisaggregationSpec:
    """Prefill / decode disaggregation (platform/replica/disaggregated.py): P replicas compute prompts
    and first tokens, D replicas adopt their KV and decode."""

    prefill_replicas: int = 1
    decode_replicas: int = 1
    prefill_retry_s: float = 60.0  # a decode replica retries dead prefill replicas this long
    # Context parallelism on the prefill replicas: a greedy prompt of at least `cp_threshold_tokens`
    # tokens is computed over `cp_ranks` ranks (replicas/context_parallel/); 1: never.
    cp_ranks: int = 1
    cp_threshold_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.prefill_replicas < 1 or self.decode_replicas < 1 or self.cp_ranks < 1:
            raise ValueError("disaggregation: prefill_replicas, decode_replicas and cp_ranks must be >= 1")


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its checkpoint, its replicas and how requests reach them."""

    name: str
    path: str
    replicas: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    num_cpus: float = 0.0  # per replica; 0 lets a small machine host every replica
    num_gpus: float | None = None  # per replica; None: 1 for a CUDA device, else 0
    # One replica over tensor x expert parallel ranks: a placement group of that many bundles per
    # replica (one GPU each on CUDA, `cpus_per_rank` CPUs each), the replica itself rank 0 in bundle 0.
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    cpus_per_rank: float = 1.0
    # Custom Ray resources per replica (e.g. {"antumbra_gpu_x4": 1}): which nodes may host it. A node
    # offering that resource (`ray start --resources`, a KubeRay group's `resources`) takes the
    # replicas, so one model's replicas keep to the nodes meant for them.
    resources: Mapping[str, float] = field(default_factory=dict)
    max_ongoing_requests: int = 32  # per replica; the engine batches all of them
    max_queued_requests: int = 256  # per ingress replica, beyond which callers get 503
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    # One step's token budget (prefill chunks included); None: the engine's default for its device
    # (`config.AUTO_TOKEN_BUDGET`: 8192 on CUDA, 2048 on the CPU).
    max_num_batched_tokens: int | None = None
    # Inter-token latency a step with decodes keeps to, by bounding the prefill beside them
    # (the engine's `SchedulerConfig.itl_budget_ms`); None: prefills take what the budget leaves.
    itl_budget_ms: float | None = None
    # Prompt tokens a step beside decodes may run as rows of the decode graphs (the engine's
    # `FastPathConfig.prefill_rows`); 0: prompt chunks run on the general step.
    prefill_rows: int = 0
    # The engine's scheduling policy: "fair_share" across tenants (weights, classes, SLOs), or "fifo".
    scheduler_policy: str = "fair_share"
    num_virtual_tokens: int | None = None  # KV capacity in tokens (the engine's CacheConfig)
    # HiSparse: CSA compressed rows on the host tier, this many device rows per request and layer.
    hisparse_rows_per_request: int | None = None
    # Warm every kernel variant and decode graph before the replica reports ready: "auto" on CUDA.
    warmup: str = "auto"
    # "release": the release checkpoints' FP8 / FP4 round trips (replicas/model/numerics.py)
    numerics: str = "exact"
    # "module:Class" of a Ray Serve RequestRouter; None: Ray's default (power of two choices)
    router: str | None = "antumbra.platform.routing.router:CacheAffinityRouter"
    router_kwargs: Mapping[str, Any] = field(default_factory=dict)
    routing_stats_period_s: float = 1.0
    autoscaling: AutoscalingSpec | None = None
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 60.0
    disaggregation: DisaggregationSpec | None = None
    # Chat answers think unless a request says otherwise (for encodings that can think, e.g. V4).
    thinking_default: bool = False
    # Speculative decoding with the checkpoint's MTP block: drafts per step (0: off), the most
    # decoding requests at which a replica still speculates (None: the engine's default), a JSON
    # file of the token ids the drafter scores (None: the whole vocabulary), and "measured" to also
    # stop where the replica measures speculating steps slower per token ("fixed": the cap alone).
    speculative_tokens: int = 0
    speculative_max_batch: int | None = None
    speculative_token_map: str | None = None
    speculative_gate: Literal["fixed", "measured"] = "fixed"
    # How long the replica's threads may hold the GIL while another waits for it (Python's switch
    # interval, its default 5000 us): the engine's stepping thread releases the GIL at every device
    # wait and, while the event loop streams other requests, waits this long to take it back.
    # None leaves Python's default.
    gil_switch_interval_us: float | None = DEFAULT_GIL_SWITCH_INTERVAL_US
    # Once ready, the replica keeps its start-up objects out of the garbage collector's walks, which
    # would otherwise stop the engine mid-step (`replica/heap.py`).
    freeze_heap: bool = True
    # The engine in a process of its own beside the replica's (`replica/engine_process.py`), so its
    # stepping thread does not share an interpreter lock with Serve's request handling. A replica
    # over one rank only, and not a disaggregated one. None: on for such a replica on CUDA, where it
    # was measured to pay (docs/performance.md), off on the CPU.
    engine_process: bool | None = None

    def __post_init__(self) -> None:
        if not self.name or "#" in self.name:
            raise ValueError(f"model name {self.name!r} must be non-empty and contain no '#'")
        if self.replicas < 1 or self.max_ongoing_requests < 1:
            raise ValueError(f"model {self.name!r}: replicas and max_ongoing_requests must be >= 1")
        if self.numerics not in ("exact", "release"):
            raise ValueError(
                f"model {self.name!r}: numerics must be 'exact' or 'release', not {self.numerics!r}"
            )
        if self.scheduler_policy not in POLICIES:
            raise ValueError(f"model {self.name!r}: scheduler_policy must be one of {sorted(POLICIES)}, "
                             f"not {self.scheduler_policy!r}")
        object.__setattr__(self, "path", _absolute(self.path))
        if self.gil_switch_interval_us is not None and not self.gil_switch_interval_us > 0:
            raise ValueError(
                f"model {self.name!r}: gil_switch_interval_us must be > 0 (or null for Python's default)")
        if self.prefill_rows < 0:
            raise ValueError(f"model {self.name!r}: prefill_rows must be >= 0, got {self.prefill_rows}")
        if self.tensor_parallel_size < 1 or self.expert_parallel_size < 1:
            raise ValueError(
                f"model {self.name!r}: tensor_parallel_size and expert_parallel_size must be >= 1")
        if self.num_gpus is None:
            object.__setattr__(self, "num_gpus", 1.0 if self.device.startswith("cuda") else 0.0)
        if isinstance(self.autoscaling, Mapping):
            autoscaling = build_spec(AutoscalingSpec, self.autoscaling, "autoscaling")
            object.__setattr__(self, "autoscaling", autoscaling)
        if isinstance(self.disaggregation, Mapping):
            split = build_spec(DisaggregationSpec, self.disaggregation, f"models[{self.name}].disaggregation")
            object.__setattr__(self, "disaggregation", split)
        single = self.world_size == 1 and self.disaggregation is None
        if self.engine_process is None:
            object.__setattr__(self, "engine_process", single and self.device.startswith("cuda"))
        if self.engine_process and not single:
            raise ValueError(f"model {self.name!r}: engine_process runs the engine of a replica over one "
                             "rank; it does not combine with tensor / expert parallelism or disaggregation")
        if self.disaggregation is not None and self.autoscaling is not None:
            raise ValueError(
                f"model {self.name!r}: disaggregation takes fixed replica counts, not autoscaling"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.expert_parallel_size

    def replica_placement(self) -> dict[str, Any]:
        """`serve.deployment` options placing one replica: its actor's resources, and for a replica
        over several ranks one placement group per replica (STRICT_PACK: the ranks talk over NVLink
        or shared memory) whose bundle 0 holds the replica actor, rank 0."""
        custom = {k: float(v) for k, v in self.resources.items()}
        extra = {"resources": custom} if custom else {}
        if self.world_size == 1:
            return {"ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **extra}}
        gpus = 1.0 if self.device.startswith("cuda") else 0.0
        rank = {"CPU": float(self.cpus_per_rank), **({"GPU": gpus} if gpus else {})}
        # The custom resources ride on bundle 0 (the replica actor's): STRICT_PACK puts the rest beside it.
        first = {**rank, "CPU": float(self.cpus_per_rank + self.num_cpus), **custom}
        return {
            "ray_actor_options": {"num_cpus": first["CPU"], "num_gpus": gpus, **extra},
            "placement_group_bundles": [first] + [dict(rank) for _ in range(self.world_size - 1)],
            "placement_group_strategy": "STRICT_PACK",
        }

    def engine_kwargs(self) -> dict[str, Any]:
        limits = (("max_model_len", self.max_model_len), ("max_num_seqs", self.max_num_seqs),
                  ("max_num_batched_tokens", self.max_num_batched_tokens),
                  ("itl_budget_ms", self.itl_budget_ms))
        overrides: dict[str, Any] = {k: v for k, v in limits if v}
        if self.scheduler_policy != SchedulerConfig.policy:
            overrides["policy"] = self.scheduler_policy
        kwargs: dict[str, Any] = {"scheduler": SchedulerConfig(**overrides)} if overrides else {}
        cache: dict[str, Any] = {"num_virtual_tokens": self.num_virtual_tokens,
                                 "hisparse_rows_per_request": self.hisparse_rows_per_request}
        if any(cache.values()):
            kwargs["cache"] = CacheConfig(**{k: v for k, v in cache.items() if v})
        if self.prefill_rows:
            kwargs["fast"] = FastPathConfig(prefill_rows=self.prefill_rows)
        if self.numerics != "exact":
            kwargs["numerics"] = self.numerics
        if self.warmup != "auto":
            kwargs["warmup"] = self.warmup
        if self.speculative_tokens:
            kwargs["speculative_tokens"] = self.speculative_tokens
            if self.speculative_max_batch is not None:
                kwargs["speculative_max_batch"] = self.speculative_max_batch
            if self.speculative_token_map is not None:
                kwargs["speculative_token_map"] = self.speculative_token_map
            if self.speculative_gate != "fixed":
                kwargs["speculative_gate"] = self.speculative_gate
        if self.world_size > 1:
            kwargs.update(tensor_parallel_size=self.tensor_parallel_size,
                          expert_parallel_size=self.expert_parallel_size, rank_cpus=self.cpus_per_rank)
        return kwargs


    def replica_kwargs(self) -> dict[str, Any]:
        """The `ModelServer` settings beside the engine's."""
        return {"engine_kwargs": self.engine_kwargs(),
                "gil_switch_interval_s": _seconds(self.gil_switch_interval_us),
                "freeze_heap": self.freeze_heap, **({"engine_process": True} if self.engine_process else {})}


@dataclass(frozen=True)
class PlatformConfig:
    """Everything `build_app` needs. `redis_url` is required: tenants, limits and the directory live there."""

    models: tuple[ModelSpec, ...]
    redis_url: str
    admin_key: str | None = None
    tenants_file: str | None = None
    ingress_replicas: int = 1
    # Custom Ray resources per ingress replica (e.g. {"antumbra_head": 1} keeps it on the head node).
    ingress_resources: Mapping[str, float] = field(default_factory=dict)
    ingress_max_ongoing_requests: int = 1000  # the ingress only awaits I/O; the replicas bound real work
    # Each ingress process's GIL switch interval (`IngressSettings.gil_switch_interval_s`); null: Python's,
    # the default (50 us measured no better through the platform: docs/performance.md).
    ingress_gil_switch_interval_us: float | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 512
    stream_idle_timeout_s: float = 120.0
    max_retries: int = 2
    # Refuse (503) what the running replicas cannot start now instead of queueing it
    # (ingress/capacity.py), for models with a fixed replica count: an autoscaled model's demand
    # must show in Ray's queue.
    capacity_gate: bool = True
    publisher: str | None = DEFAULT_PUBLISHER  # "module:fn(engine, replica_id, model_name, redis_url)"
    request_observer: str | None = "antumbra.platform.metrics:observe_request"  # "module:fn(RequestRecord)"
    key_prefix: str = "antumbra"
    redis_owner: str = "external"  # "platform" when the launcher started Redis and restarts it (`/health`)
    # The prefix directory sharded over these Redis servers (by replica: routing/sharded_directory.py);
    # empty: it lives in `redis_url` with tenants and limits.
    directory_redis_urls: tuple[str, ...] = ()
    # Serve's event loops in the processes of a cluster the platform starts (`serve_env.py`)
    serve_loops: str = DEFAULT_SERVE_LOOPS

    def __post_init__(self) -> None:
        serve_loop_env(self.serve_loops)  # fails early on an unknown setting
        models = tuple(self.models.values()) if isinstance(self.models, Mapping) else tuple(self.models)
        if not models:
            raise ValueError("at least one model is required")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if len({model_deployment_name(n) for n in names}) != len(names):
            raise ValueError(f"model names {names} map to clashing deployment names")
        object.__setattr__(self, "models", models)
        if not self.redis_url:
            raise ValueError(f"a Redis URL is required (redis_url, or ${env.REDIS_URL})")
        if self.ingress_gil_switch_interval_us is not None and not self.ingress_gil_switch_interval_us > 0:
            raise ValueError("ingress_gil_switch_interval_us must be > 0 (or null for Python's default)")
        if self.tenants_file:
            object.__setattr__(self, "tenants_file", _absolute(self.tenants_file))
        urls = self.directory_redis_urls
        urls = (urls,) if isinstance(urls, str) else urls
        if not all(isinstance(u, str) and u for u in urls):
            raise ValueError(f"directory_redis_urls must be Redis URLs, got {self.directory_redis_urls!r}")
        object.__setattr__(self, "directory_redis_urls", tuple(urls))

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlatformConfig:
        """From a mapping: `models` is a list of model mappings or a mapping name -> model mapping."""
        data = dict(data)
        raw_models = data.pop("models", None) or {}
        if isinstance(raw_models, Mapping):
            raw_models = [{"name": name, **(spec or {})} for name, spec in raw_models.items()]
        models = tuple(build_spec(ModelSpec, m, f"models[{i}]") for i, m in enumerate(raw_models))
        return build_spec(cls, {**data, "models": models}, "config")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> PlatformConfig:
        return cls.from_dict({**read_config_file(path), **overrides})

    def ingress_settings(self) -> IngressSettings:
        return IngressSettings(
            redis_url=self.redis_url,
            model_paths={m.name: m.path for m in self.models},
            model_thinking_default={m.name: m.thinking_default for m in self.models},
            admin_key=self.admin_key,
            tenants_file=self.tenants_file,
            max_body_bytes=self.max_body_bytes,
            default_max_tokens=self.default_max_tokens,
            stream_idle_timeout_s=self.stream_idle_timeout_s,
            max_retries=self.max_retries,
            key_prefix=self.key_prefix,
            redis_owner=self.redis_owner,
            request_observer=self.request_observer,
            gil_switch_interval_s=_seconds(self.ingress_gil_switch_interval_us),
            model_deployments={m.name: model_deployment_name(m.name) for m in self.models},
            model_max_ongoing={m.name: m.max_ongoing_requests for m in self.models
                               if self.capacity_gate and m.autoscaling is None},
        )


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML (or JSON, which is YAML) mapping."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def model_deployment_name(model: str) -> str:
    """The Serve deployment of a model: its name with characters outside [A-Za-z0-9_.-] replaced."""
    return "Model-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model)


# ---------------------------------------------------------------------------------------------- helpers


def _absolute(path: str) -> str:
    # Replicas may run in another working directory than the process that read the config.
    return str(Path(path).expanduser().resolve())


def build_spec(cls: type, data: Any, where: str) -> Any:
    """A config dataclass from a mapping, with errors that name the place and the bad keys."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _seconds(microseconds: float | None) -> float | None:
    return microseconds * 1e-6 if microseconds is not None else None
