"""Serve's event loops: the setting's environment, set around the start of a cluster and in manifests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from antumbra.platform.launch.platform_config import PlatformConfig
from antumbra.platform.launch.serve_env import (
    DEFAULT_SERVE_LOOPS,
    SERVE_LOOPS,
    serve_environment,
    serve_loop_env,
)

USER_CODE = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
ROUTER = "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"
ROOT = Path(__file__).resolve().parents[3]


def test_each_setting_names_both_of_serves_loop_variables() -> None:
    assert serve_loop_env("one") == {USER_CODE: "0", ROUTER: "0"}
    assert serve_loop_env("separate") == {USER_CODE: "1", ROUTER: "1"}
    assert set(SERVE_LOOPS) == {"one", "separate"}
    with pytest.raises(ValueError, match="serve_loops must be one of"):
        serve_loop_env("two")


def test_the_environment_is_set_inside_the_block_and_as_before_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(USER_CODE, "1")
    monkeypatch.delenv(ROUTER, raising=False)
    with serve_environment(serve_loop_env("one")):
        assert (os.environ[USER_CODE], os.environ[ROUTER]) == ("0", "0")
    assert os.environ[USER_CODE] == "1"
    assert ROUTER not in os.environ
    with pytest.raises(RuntimeError), serve_environment({ROUTER: "0"}):
        raise RuntimeError("an interrupted start")
    assert ROUTER not in os.environ


def test_the_platform_config_refuses_an_unknown_setting() -> None:
    model = {"path": "/nowhere"}
    config = PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1", "models": {"m": model}})
    assert config.serve_loops == DEFAULT_SERVE_LOOPS == "separate"  # Serve's own default
    with pytest.raises(ValueError, match="serve_loops"):
        PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1", "models": {"m": model},
                                  "serve_loops": "threads"})


def test_the_kuberay_pods_start_with_the_setting() -> None:
    service = yaml.safe_load((ROOT / "infra" / "kuberay" / "rayservice.yaml").read_text())
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert {USER_CODE: env[USER_CODE], ROUTER: env[ROUTER]} == serve_loop_env(DEFAULT_SERVE_LOOPS)
