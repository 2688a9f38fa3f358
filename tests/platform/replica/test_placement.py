"""Placement groups for multi-rank replicas, on CPU with real Ray: bundles, rank workers, gloo all-reduce."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from antumbra.platform.replica.placement import RankGroup, deployment_options, placement_bundles


def test_bundles_one_per_rank_with_the_replica_in_bundle_0() -> None:
    assert placement_bundles(2, 0, 1) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert (
        placement_bundles(4, 1, 8, replica_cpus=1)
        == [{"CPU": 9.0, "GPU": 1.0}] + [{"CPU": 8.0, "GPU": 1.0}] * 3
    )
    options = deployment_options(2, 0, 0.5, strategy="PACK")
    assert options["placement_group_strategy"] == "PACK"
    assert options["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert options["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 0}
    with pytest.raises(ValueError):
        placement_bundles(0, 0, 1)
    with pytest.raises(ValueError):
        placement_bundles(2, 0, 0)
    with pytest.raises(ValueError):
        deployment_options(2, 0, 1, strategy="SPREAD")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()


def test_rank_group_packs_two_cpu_bundles_and_all_reduces(ray_cluster: None) -> None:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pg = placement_group(placement_bundles(2, 0, 1), strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    group = RankGroup(2, cpus_per_rank=1, placement_group=pg, timeout_s=60).start()
    try:
        assert group.backend == "gloo"
        assert group.check()
        placements = group.placements()
        table = placement_group_table(pg)
        assert table["strategy"] == "STRICT_PACK"
        assert len(set(table["bundles_to_node_id"].values())) == 1  # packed on one node
        assert {p["node_id"] for p in placements} == set(table["bundles_to_node_id"].values())
        for rank, placement in enumerate(placements):
            assert placement["placement_group_id"] == pg.id.hex()
            assert placement["rank"] == rank and placement["captures_child_tasks"]
            assert placement["resources"] == {"CPU": 1.0}  # each rank has a whole bundle to itself
    finally:
        group.shutdown()
        remove_placement_group(pg)


def test_a_serve_replica_starts_its_ranks_in_its_own_placement_group(ray_cluster: None) -> None:
    from ray import serve

    @serve.deployment(num_replicas=1, **deployment_options(2, gpus_per_rank=0, cpus_per_rank=0.5))
    class GroupReplica:
        def __init__(self) -> None:
            self.group = RankGroup(2, cpus_per_rank=0.5, timeout_s=60).start()

        def check(self) -> dict[str, Any]:
            import ray

            pg = self.group.placement_group
            return {
                "ok": self.group.check(),
                "own_pg": pg is not None
                and pg.id.hex() == ray.get_runtime_context().get_placement_group_id(),
                "worker_pgs": {p["placement_group_id"] for p in self.group.placements()},
            }

        def __del__(self) -> None:
            self.group.shutdown()

    handle = serve.run(GroupReplica.bind(), name="placement-test", route_prefix=None)
    result = handle.check.remote().result(timeout_s=60)
    assert result["ok"] and result["own_pg"]
    assert len(result["worker_pgs"]) == 1
    serve.delete("placement-test")
