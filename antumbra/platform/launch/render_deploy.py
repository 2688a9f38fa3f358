"""`antumbra render-deploy --spec FILE --out DIR`: the Ray Serve config and the KubeRay RayService
for a deployment spec (`deploy_spec.DeploySpec`).

What it writes:
  * `serve.yaml`: the Serve application (`app:app_builder` with the spec's models). Each model's
    replicas take one unit of its own custom Ray resource, which only its worker group's nodes
    offer (as many units as replicas fit a node), so replicas keep to the nodes shaped for them
    and a 4-GPU gang never waits behind 1-GPU replicas that fragmented its node. A replica over
    TP x EP ranks gets one STRICT_PACK placement group (one GPU per rank, all on one node). The
    ingress replicas take the head's `antumbra_head` resource: they run on the head.
  * `rayservice.yaml`: a `ray.io/v1` RayService whose `serveConfigV2` is that config; one worker
    group per model (node counts from the replica counts, min / max from autoscaling), the head
    without CPUs for replicas, the Redis URL and admin key from secrets (`redis.directory_urls`, if
    any, become the app's `directory_redis_urls`: a sharded prefix directory), and with `redis.address`
    set, GCS fault tolerance on the same external Redis (Ray's state survives the head's loss;
    `infra/README.md` says what that covers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from antumbra.platform.launch.deploy_spec import DeploySpec, ModelDeploy, NodeShape
from antumbra.platform.launch.serve_env import serve_loop_env

HEAD_RESOURCE = "antumbra_head"
HEAD_RESOURCE_UNITS = 1000  # ingress replicas each take 1
ROUTER = "antumbra.platform.routing.router:CacheAffinityRouter"
MODELS_MOUNT = "/models"


def serve_config(spec: DeploySpec) -> dict[str, Any]:
    """The Serve config (`serve deploy` / `serveConfigV2`) for the spec's models."""
    models = {}
    for model in spec.models:
        entry: dict[str, Any] = {
            "max_ongoing_requests": spec.max_ongoing_requests,
            "router": ROUTER,
            "router_kwargs": {"page_size": spec.page_size},
            **dict(model.model),
        }
        entry["resources"] = {**dict(entry.get("resources") or {}), model.resource: 1}
        models[model.name] = entry
    shards = {"directory_redis_urls": list(spec.redis.directory_urls)} if spec.redis.directory_urls else {}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": spec.http_port, "keep_alive_timeout_s": 75},
        "applications": [{
            "name": "antumbra",
            "route_prefix": "/",
            "import_path": "antumbra.platform.launch.app:app_builder",
            "args": {
                "ingress_replicas": spec.ingress_replicas,
                "ingress_resources": {HEAD_RESOURCE: 1},
                "request_observer": "antumbra.platform.metrics:observe_request",
                **shards,
                "models": models,
            },
        }],
    }


def _env(spec: DeploySpec) -> list[dict[str, Any]]:
    env = [{"name": "ANTUMBRA_REDIS_URL", **spec.redis.url_secret.env_source()}]
    if spec.admin_key_secret is not None:
        env.append({"name": "ANTUMBRA_ADMIN_KEY", **spec.admin_key_secret.env_source()})
    serve = [{"name": n, "value": v} for n, v in serve_loop_env(spec.serve_loops).items()]
    return [*env, {"name": "ANTUMBRA_CACHE_DIR", "value": "/tmp/antumbra"}, *serve]


def _quantities(node: NodeShape, gpus: int) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": _number(node.cpus), "memory": node.memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _pod(spec: DeploySpec, container: str, node: NodeShape, gpus: int, ports: list[dict[str, Any]]
         ) -> dict[str, Any]:
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": node.shm}}
    ]
    if spec.models_volume_claim:
        mounts.append({"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": spec.models_volume_claim,
                                                                     "readOnly": True}})
    pod: dict[str, Any] = {
        "containers": [{
            "name": container,
            "image": spec.image,
            "imagePullPolicy": "IfNotPresent",
            "env": _env(spec),
            "ports": ports,
            "resources": _quantities(node, gpus),
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
    }
    if gpus:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": pod}


def _worker_group(spec: DeploySpec, model: ModelDeploy) -> dict[str, Any]:
    nodes, low, high = model.node_counts()
    return {
        "groupName": model.group,
        "replicas": nodes,
        "minReplicas": low,
        "maxReplicas": high,
        "rayStartParams": {},
        "resources": {model.resource: str(model.replicas_per_node)},
        "template": _pod(spec, "ray-worker", model.node, model.node_gpus,
                         [{"containerPort": 8080, "name": "metrics"}]),
    }


def ray_service(spec: DeploySpec) -> dict[str, Any]:
    """The `ray.io/v1` RayService (KubeRay v1.5 or later: group `resources`)."""
    head_ports = [{"containerPort": port, "name": name} for port, name in
                  ((6379, "gcs-server"), (8265, "dashboard"), (10001, "client"), (spec.http_port, "serve"),
                   (8080, "metrics"))]
    autoscaled = any(m.spec.autoscaling is not None for m in spec.models)
    cluster: dict[str, Any] = {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": autoscaled,
        "headGroupSpec": {
            # No CPUs for Ray's scheduler on the head: nothing but the controller, a proxy and the
            # ingress (which takes no CPU, only the head's resource) runs there.
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
            "resources": {HEAD_RESOURCE: str(HEAD_RESOURCE_UNITS)},
            "template": _pod(spec, "ray-head", spec.head, 0, head_ports),
        },
        "workerGroupSpecs": [_worker_group(spec, m) for m in spec.models],
    }
    if autoscaled:  # Serve asks for replicas, the autoscaler for the nodes to hold them
        cluster["autoscalerOptions"] = {"upscalingMode": "Default", "idleTimeoutSeconds": 600}
    if spec.redis.address is not None:
        ft: dict[str, Any] = {"redisAddress": spec.redis.address}
        if spec.redis.password_secret is not None:
            ft["redisPassword"] = spec.redis.password_secret.env_source()
        cluster["gcsFaultToleranceOptions"] = ft
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {
            "upgradeStrategy": {"type": "NewCluster"},
            "serveConfigV2": yaml.safe_dump(serve_config(spec), sort_keys=False),
            "rayClusterConfig": cluster,
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded Serve config) as literal blocks, readable in the file."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100)


HEADER = """# Rendered by `antumbra render-deploy --spec {spec}`; edit the spec, not this file.
"""


def render(spec_path: str | Path, out_dir: str | Path) -> list[Path]:
    """Write `serve.yaml` and `rayservice.yaml` for the spec into `out_dir`; returns their paths."""
    spec = DeploySpec.from_file(spec_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(spec=Path(spec_path).name)
    written = []
    for name, document in (("serve.yaml", serve_config(spec)), ("rayservice.yaml", ray_service(spec))):
        path = out / name
        path.write_text(header + dump(document))
        written.append(path)
    return written


def run_render(args: argparse.Namespace) -> int:
    try:
        for path in render(args.spec, args.out):
            print(path)
    except (ValueError, OSError) as exc:
        print(f"antumbra render-deploy: {exc}", file=sys.stderr)
        return 2
    return 0
