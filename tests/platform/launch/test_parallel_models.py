"""A model spec over several ranks: one placement group per replica, the replica actor in
bundle 0 as rank 0; `antumbra serve --tp T --ep E` and config files pass the sizes through."""

from __future__ import annotations

import argparse

import pytest

from antumbra.platform.launch.platform_config import ModelSpec
from antumbra.platform.launch.serve_cli import add_serve, config_from_args


def test_a_tp2_ep2_cuda_model_gets_four_gpu_bundles_per_replica() -> None:
    spec = ModelSpec(name="flash", path="/models/flash", device="cuda", tensor_parallel_size=2,
                     expert_parallel_size=2, cpus_per_rank=4, num_cpus=2)
    placement = spec.replica_placement()
    assert placement["placement_group_strategy"] == "STRICT_PACK"
    assert placement["placement_group_bundles"] == [{"CPU": 6.0, "GPU": 1.0}] + [{"CPU": 4.0, "GPU": 1.0}] * 3
    # The replica actor is rank 0: it must fit bundle 0 exactly.
    assert placement["ray_actor_options"] == {"num_cpus": 6.0, "num_gpus": 1.0}
    kwargs = spec.engine_kwargs()
    assert (kwargs["tensor_parallel_size"], kwargs["expert_parallel_size"], kwargs["rank_cpus"]) == (2, 2, 4)


def test_one_rank_models_keep_their_plain_actor_options() -> None:
    spec = ModelSpec(name="tiny", path="/models/tiny")
    assert spec.replica_placement() == {"ray_actor_options": {"num_cpus": 0.0, "num_gpus": 0.0}}
    assert "tensor_parallel_size" not in spec.engine_kwargs()
    cpu = ModelSpec(name="tiny", path="/models/tiny", expert_parallel_size=2, cpus_per_rank=0.5)
    assert cpu.replica_placement()["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelSpec(name="bad", path="/m", tensor_parallel_size=0)


def test_serve_flags_pass_the_parallel_sizes() -> None:
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    flags = ["--model", "/models/flash", "--tp", "2", "--ep", "2", "--device", "cuda"]
    args = parser.parse_args(["serve", *flags])
    models = config_from_args(args)["models"]
    assert models == {"flash": {"path": "/models/flash", "device": "cuda", "tensor_parallel_size": 2,
                                "expert_parallel_size": 2}}
