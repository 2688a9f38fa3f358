"""The scheduling policy as a plan option: `antumbra serve --scheduler-policy`, a model spec's
`scheduler_policy`, the engine's `SchedulerConfig.policy`; an unknown name fails before anything runs."""

from __future__ import annotations

import argparse

import pytest

from antumbra.config import EngineConfig, SchedulerConfig
from antumbra.platform.launch.platform_config import ModelSpec
from antumbra.platform.launch.serve_cli import add_serve, config_from_args
from antumbra.replicas.plan import PlanError, SchedulingPolicyKind, resolve_plan


def test_the_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "/models/tiny", "--scheduler-policy", "fifo"])
    (spec,) = config_from_args(args)["models"].values()
    assert spec == {"path": "/models/tiny", "scheduler_policy": "fifo"}
    kwargs = ModelSpec(name="tiny", **spec).engine_kwargs()
    assert kwargs["scheduler"].policy == "fifo"
    assert "scheduler" not in ModelSpec(name="tiny", path="/m").engine_kwargs()  # fair share: the default
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduler-policy", "lottery"])


def test_an_unknown_policy_fails_in_the_spec_and_the_plan() -> None:
    with pytest.raises(ValueError, match="scheduler_policy"):
        ModelSpec(name="tiny", path="/m", scheduler_policy="lottery")
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64, policy="lottery"))
    with pytest.raises(PlanError, match="lottery"):
        resolve_plan(config)
    fifo = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64, policy="fifo"))
    assert resolve_plan(fifo).scheduling is SchedulingPolicyKind.FIFO
