"""Rebuild `rayservice_v1_schema.json` from KubeRay's published RayService CRD (see README.md).

    cd tests/platform/launch/data
    python prune_crd.py ray.io_rayservices.yaml > rayservice_v1_schema.json

Keeps the `v1` OpenAPI schema whole except: descriptions go, and every pod spec keeps only the
fields a rendered RayService may use (the full core/v1 PodSpec is most of the CRD's size).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

POD_SPEC_FIELDS = ("containers", "volumes", "tolerations", "nodeSelector", "serviceAccountName")
CONTAINER_FIELDS = ("name", "image", "imagePullPolicy", "env", "ports", "resources", "volumeMounts",
                    "command", "args")
VOLUME_FIELDS = ("name", "persistentVolumeClaim", "emptyDir", "secret", "configMap")


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def keep(schema: dict[str, Any], fields: tuple[str, ...]) -> None:
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k in fields}


def prune_pod_template(template: dict[str, Any]) -> None:
    spec = template["properties"]["spec"]
    keep(spec, POD_SPEC_FIELDS)
    keep(spec["properties"]["containers"]["items"], CONTAINER_FIELDS)
    keep(spec["properties"]["volumes"]["items"], VOLUME_FIELDS)


def main(path: str) -> None:
    crd = yaml.safe_load(open(path))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strip(version["schema"]["openAPIV3Schema"])
    cluster = schema["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"]
    prune_pod_template(cluster["headGroupSpec"]["properties"]["template"])
    prune_pod_template(cluster["workerGroupSpecs"]["items"]["properties"]["template"])
    del schema["properties"]["status"]  # the operator writes status, never the user
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
