"""`antumbra render-deploy`: the rendered RayService validates against KubeRay's CRD schema (test data,
`data/README.md` says its version and source), its Serve config against Ray Serve's own schema, and
the app it describes builds with the placement the spec asks for."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from antumbra.cli import main
from antumbra.platform.launch.app import DRAIN_POLL_S, app_builder, model_deployment_name
from antumbra.platform.launch.deploy_spec import DeploySpec
from antumbra.platform.launch.render_deploy import HEAD_RESOURCE, ray_service

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = Path(__file__).with_name("data") / "rayservice_v1_schema.json"
FLASH_SPEC = ROOT / "infra" / "deploy" / "v4-flash.yaml"
PLATFORM_SPEC = ROOT / "infra" / "deploy" / "platform.yaml"


def closed(schema: Any) -> Any:
    """The schema with unknown fields refused: the API server would silently drop (prune) them,
    so a misspelt field would deploy as if absent."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    open_ended = "additionalProperties" in out or out.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    import json

    schema = closed(json.loads(SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def render(spec: Path, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    assert main(["render-deploy", "--spec", str(spec), "--out", str(out)]) == 0
    service, serve_config = ((out / name).read_text() for name in ("rayservice.yaml", "serve.yaml"))
    return yaml.safe_load(service), yaml.safe_load(serve_config)


def errors(validator: jsonschema.Draft7Validator, document: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_v4_flash_at_tp2_ep2_validates_and_builds(
    validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    service, serve_config = render(FLASH_SPEC, tmp_path)
    assert errors(validator, service) == []
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded == serve_config
    ServeDeploySchema.model_validate(embedded)

    cluster = service["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    # One 4-GPU node per replica; the node offers one unit of the model's resource.
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
    assert group["resources"] == {"antumbra_deepseek_v4_flash": "1"}
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["gcsFaultToleranceOptions"]["redisAddress"] == "redis.antumbra.svc:6379"

    args = embedded["applications"][0]["args"]
    app = app_builder({**args, "redis_url": "redis://redis.antumbra.svc:6379/0"})
    ingress = app._bound_deployment
    assert ingress.ray_actor_options["resources"] == {HEAD_RESOURCE: 1.0}
    model = ingress.init_args[1]["deepseek-v4-flash"]._bound_deployment
    assert model.name == model_deployment_name("deepseek-v4-flash")
    bundles = model._replica_config.placement_group_bundles
    assert model._replica_config.placement_group_strategy == "STRICT_PACK"
    assert [b["GPU"] for b in bundles] == [1.0] * 4
    assert bundles[0]["antumbra_deepseek_v4_flash"] == 1.0
    assert sum(b["CPU"] for b in bundles) <= float(worker["resources"]["limits"]["cpu"])
    # A draining replica (scaled down, replaced, shut down) counts its requests every DRAIN_POLL_S.
    for deployment in (ingress, model):
        assert deployment._deployment_config.graceful_shutdown_wait_loop_s == DRAIN_POLL_S < 2.0


def test_committed_kuberay_files_are_the_spec_rendered(
    validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    service, _ = render(PLATFORM_SPEC, tmp_path)
    assert errors(validator, service) == []
    for name in ("rayservice.yaml", "serve.yaml"):
        committed = (ROOT / "infra" / "kuberay" / name).read_text()
        assert committed == (tmp_path / name).read_text(), f"re-render infra/kuberay/{name} from the spec"
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert (groups["deepseek-v4"]["minReplicas"], groups["deepseek-v4"]["maxReplicas"]) == (2, 8)
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_the_schema_refuses_what_kuberay_would_refuse_or_drop(
    validator: jsonschema.Draft7Validator, tmp_path: Path
) -> None:
    service, _ = render(FLASH_SPEC, tmp_path)
    broken = []
    misspelt = copy.deepcopy(service)
    misspelt["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    broken.append(misspelt)
    wrong_type = copy.deepcopy(service)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "2"
    broken.append(wrong_type)
    no_template = copy.deepcopy(service)
    del no_template["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    broken.append(no_template)
    bad_quantity = copy.deepcopy(service)
    bad_quantity["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]["memory"] = "16 gigabytes"
    broken.append(bad_quantity)
    assert [len(errors(validator, doc)) > 0 for doc in broken] == [True] * 4


def _spec(**model: Any) -> dict[str, Any]:
    return {"name": "t", "image": "img", "redis": {"url_secret": {"name": "s", "key": "url"}},
            "models": {"m": {"path": "/models/m", "device": "cuda", **model}}}


def test_replica_and_node_counts_follow_the_spec(validator: jsonschema.Draft7Validator) -> None:
    split = DeploySpec.from_dict(_spec(disaggregation={"prefill_replicas": 2, "decode_replicas": 3},
                                       node={"gpus": 2}))
    (group,) = ray_service(split)["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["replicas"], group["resources"]) == (3, {"antumbra_m": "2"})  # 5 one-GPU replicas, 2 a node
    scaled = DeploySpec.from_dict(_spec(autoscaling={"min_replicas": 1, "max_replicas": 5}, node={"gpus": 2}))
    service = ray_service(scaled)
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 3)
    assert "gcsFaultToleranceOptions" not in service["spec"]["rayClusterConfig"]  # no redis.address
    assert errors(validator, service) == []


def test_a_sharded_directory_is_rendered_into_the_app(validator: jsonschema.Draft7Validator) -> None:
    urls = ["redis://dir-0.antumbra.svc:6379/0", "redis://dir-1.antumbra.svc:6379/0"]
    spec = _spec()
    spec["redis"]["directory_urls"] = urls
    service = ray_service(DeploySpec.from_dict(spec))
    assert errors(validator, service) == []
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    args = embedded["applications"][0]["args"]
    assert args["directory_redis_urls"] == urls
    app = app_builder({**args, "redis_url": "redis://redis.antumbra.svc:6379/0"})
    model = app._bound_deployment.init_args[1]["m"]._bound_deployment
    router = model._deployment_config.request_router_config
    assert list(router.request_router_kwargs["directory_redis_urls"]) == urls  # the router reads the shards
    hook = model.init_kwargs["on_start"]
    assert hook.directory_urls == tuple(urls)  # and the publishers write to them
    assert "directory_redis_urls" not in yaml.safe_load(ray_service(DeploySpec.from_dict(_spec()))["spec"][
        "serveConfigV2"])["applications"][0]["args"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({**_spec(), "redis": {"url_secret": {"name": "s", "key": "k"}, "directory_urls": ["dir-0:6379"]}},
         "redis.directory_urls must be redis:// URLs"),
        (_spec(tensor_parallel_size=4, expert_parallel_size=2, node={"gpus": 4}), "needs 8 GPUs of one node"),
        (_spec(node={"gpus": 1, "cpus": 2}, num_cpus=4), "one replica does not fit"),
        (_spec(replica=2), "unknown keys ['replica']"),
        (_spec(node={"gpu": 1}), "models[m].node: unknown keys ['gpu']"),
        ({**_spec(), "redis": {"url_secret": {"name": "s", "key": "k"}, "address": "redis://r:6379"}},
         "host:port"),
    ],
)
def test_a_bad_spec_is_refused_with_the_reason(
    spec: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["render-deploy", "--spec", str(path), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
