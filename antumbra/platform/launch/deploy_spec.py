"""A deployment spec: the models to serve and the cluster shape they need, read from YAML.

`antumbra render-deploy --spec FILE --out DIR` (`render_deploy.py`) turns one into the Ray Serve
config and the KubeRay `RayService`. The spec's `models` are the platform's own model mappings
(`platform_config.ModelSpec`: TP / EP sizes, disaggregation, autoscaling, ...) plus, per model, the
node shape of its worker group (`node:`). Example (infra/deploy/v4-flash.yaml):

    name: antumbra
    namespace: antumbra
    image: ghcr.io/antumbra/antumbra:0.1.0-cuda
    redis:                                 # an external Redis: directory, tenants, limits, GCS FT
      url_secret: {name: antumbra-secrets, key: redis-url}
      address: redis.antumbra.svc:6379     # host:port, for Ray's GCS fault tolerance
      password_secret: {name: antumbra-secrets, key: redis-password}
      directory_urls: [redis://dir-0.antumbra.svc:6379/0, redis://dir-1.antumbra.svc:6379/0]  # optional
    admin_key_secret: {name: antumbra-secrets, key: admin-key}
    models:
      deepseek-v4-flash:
        path: /models/deepseek-v4-flash
        device: cuda
        dtype: bfloat16
        tensor_parallel_size: 2
        expert_parallel_size: 2
        node: {gpus: 4, cpus: 20, memory: 320Gi}
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antumbra.platform.launch.platform_config import ModelSpec, build_spec, read_config_file
from antumbra.platform.launch.serve_env import DEFAULT_SERVE_LOOPS, serve_loop_env


@dataclass(frozen=True)
class SecretRef:
    """A key of a Kubernetes secret."""

    name: str
    key: str

    def env_source(self) -> dict[str, Any]:
        return {"valueFrom": {"secretKeyRef": {"name": self.name, "key": self.key}}}


@dataclass(frozen=True)
class RedisSpec:
    """The external Redis: the platform reads its URL from `url_secret`; with `address` set, Ray's
    GCS keeps its state there too (GCS fault tolerance: the head can restart without losing the
    cluster). `directory_urls`: Redis servers the prefix directory is sharded over instead
    (the platform config's `directory_redis_urls`; in-cluster addresses without secrets)."""

    url_secret: SecretRef
    address: str | None = None
    password_secret: SecretRef | None = None
    directory_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("url_secret", "password_secret"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, build_spec(SecretRef, value, f"redis.{name}"))
        urls = tuple(self.directory_urls)
        if not all(isinstance(u, str) and re.match(r"rediss?://\S+$", u) for u in urls):
            raise ValueError(f"redis.directory_urls must be redis:// URLs, got {self.directory_urls!r}")
        object.__setattr__(self, "directory_urls", urls)
        if self.address is not None and not re.fullmatch(r"[^\s:/]+:\d+", self.address):
            raise ValueError(f"redis.address must be host:port, got {self.address!r}")


@dataclass(frozen=True)
class NodeShape:
    """One Kubernetes pod = one Ray node: what its container requests (and is limited to)."""

    gpus: int | None = None  # None: the GPUs of one replica
    cpus: float = 8.0
    memory: str = "64Gi"
    shm: str = "16Gi"  # /dev/shm (Ray's object store and the ranks' shared memory)


@dataclass(frozen=True)
class ModelDeploy:
    """A model of the spec: its platform mapping (as `ModelSpec` reads it) and its node shape."""

    name: str
    model: Mapping[str, Any]
    node: NodeShape

    @property
    def spec(self) -> ModelSpec:
        return build_spec(ModelSpec, {"name": self.name, **self.model}, f"models[{self.name}]")

    @property
    def group(self) -> str:
        """The worker group's name (a DNS label)."""
        return re.sub(r"[^a-z0-9-]+", "-", self.name.lower()).strip("-")[:50] or "model"

    @property
    def resource(self) -> str:
        """The custom Ray resource that the group's nodes offer and each replica of the model takes."""
        return "antumbra_" + self.group.replace("-", "_")

    @property
    def gpus_per_replica(self) -> int:
        spec = self.spec
        if not spec.device.startswith("cuda"):
            return 0
        return spec.world_size if spec.world_size > 1 else math.ceil(spec.num_gpus or 0)

    @property
    def cpus_per_replica(self) -> float:
        spec = self.spec
        return spec.num_cpus + (spec.world_size * spec.cpus_per_rank if spec.world_size > 1 else 0.0)

    @property
    def node_gpus(self) -> int:
        return self.node.gpus if self.node.gpus is not None else self.gpus_per_replica

    @property
    def replicas_per_node(self) -> int:
        """How many replicas one node holds, by its GPUs and its CPUs (a gang is packed on one node);
        1 for a replica that asks for neither."""
        fits = []
        if self.gpus_per_replica:
            fits.append(self.node_gpus // self.gpus_per_replica)
        if self.cpus_per_replica:
            fits.append(int(self.node.cpus // self.cpus_per_replica))
        return min(fits, default=1)

    def replica_counts(self) -> tuple[int, int, int]:
        """(initial, min, max) replicas of the model (prefill and decode together when split)."""
        spec = self.spec
        if spec.disaggregation is not None:
            total = spec.disaggregation.prefill_replicas + spec.disaggregation.decode_replicas
            return total, total, total
        if spec.autoscaling is not None:
            scaling = spec.autoscaling
            start = scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas
            return start, scaling.min_replicas, scaling.max_replicas
        return spec.replicas, spec.replicas, spec.replicas

    def node_counts(self) -> tuple[int, int, int]:
        """(replicas, minReplicas, maxReplicas) of the worker group: nodes for those replica counts."""
        per_node = self.replicas_per_node
        start, low, high = self.replica_counts()
        return math.ceil(start / per_node), math.ceil(low / per_node), max(1, math.ceil(high / per_node))


@dataclass(frozen=True)
class DeploySpec:
    name: str
    image: str
    redis: RedisSpec
    models: tuple[ModelDeploy, ...]
    namespace: str = "default"
    ray_version: str = "2.60.0"
    admin_key_secret: SecretRef | None = None
    models_volume_claim: str | None = "antumbra-models"  # a ReadOnlyMany claim mounted at /models
    ingress_replicas: int = 2
    head: NodeShape = field(default_factory=lambda: NodeShape(cpus=4, memory="16Gi", shm="4Gi"))
    http_port: int = 8000
    max_ongoing_requests: int = 64
    page_size: int = 128  # the model's cache page: the router's block size
    serve_loops: str = DEFAULT_SERVE_LOOPS  # Serve's event loops in every pod (`serve_env.py`)

    def __post_init__(self) -> None:
        serve_loop_env(self.serve_loops)  # fails early on an unknown setting
        if not self.models:
            raise ValueError("a deployment spec needs at least one model")
        for model in self.models:
            model.spec  # noqa: B018  (fails early, naming the model and the bad keys)
            if model.gpus_per_replica > model.node_gpus:
                raise ValueError(
                    f"models[{model.name}]: a replica needs {model.gpus_per_replica} GPUs of one node "
                    f"(its ranks are packed together), the node has {model.node_gpus}"
                )
            if model.replicas_per_node < 1:
                raise ValueError(
                    f"models[{model.name}]: one replica does not fit its node shape "
                    f"({model.cpus_per_replica:g} CPUs a replica, the node has {model.node.cpus:g})"
                )
        groups = [m.group for m in self.models]
        if len(set(groups)) != len(groups):
            raise ValueError(f"model names {[m.name for m in self.models]} map to clashing group names")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeploySpec:
        data = dict(data)
        models = []
        for name, raw in dict(data.pop("models", None) or {}).items():
            raw = dict(raw or {})
            node = build_spec(NodeShape, raw.pop("node", None) or {}, f"models[{name}].node")
            models.append(ModelDeploy(str(name), raw, node))
        for key, kind in (("redis", RedisSpec), ("admin_key_secret", SecretRef), ("head", NodeShape)):
            if isinstance(data.get(key), Mapping):
                data[key] = build_spec(kind, data[key], key)
        return build_spec(cls, {**data, "models": tuple(models)}, "spec")

    @classmethod
    def from_file(cls, path: str | Path) -> DeploySpec:
        return cls.from_dict(read_config_file(path))
