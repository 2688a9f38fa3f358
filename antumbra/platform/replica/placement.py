"""Placement of a replica that spans several devices: one Ray placement group, one bundle per rank.

A model whose replica is an expert- or context-parallel group of `N` ranks is deployed with

    serve.deployment(**deployment_options(N, gpus_per_rank=1, cpus_per_rank=4))

which gives each replica its own placement group of `N` bundles (bundle `i` for rank `i`),
packed on one node ("STRICT_PACK"; "PACK" lets Ray spill over when a node is short).
Ray Serve starts the replica actor in bundle 0, so bundle 0 also carries the replica's own
`replica_cpus` (default 0: the replica only coordinates).

Inside the replica, `RankGroup(N, ...).start()` starts one `RankWorker` actor per rank,
rank `i` in bundle `i` of the replica's placement group (the current one, found with
`ray.util.get_current_placement_group()`; child tasks are captured in it too). Joining
`torch.distributed`:

  1. the replica asks rank 0 for an address: its node's IP and a port free on that node;
  2. it publishes that address to every worker, which calls `init_process_group` with
     `tcp://addr:port`, its rank and the world size, all concurrently (the call returns
     when every rank has joined); the backend is NCCL when ranks have GPUs, else gloo;
  3. `check()` all-reduces a tensor in which rank r holds r + 1 everywhere; every rank
     must get N(N + 1)/2. `shutdown()` leaves the process group and kills the workers.

On a CPU-only machine the same path runs with CPU bundles and gloo (the expert- and
context-parallel compute itself arrives later; `RankWorker.execute` runs any function
on a rank with its process group joined).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

Strategy = Literal["STRICT_PACK", "PACK"]
STRATEGIES: tuple[str, ...] = ("STRICT_PACK", "PACK")


def placement_bundles(
    group_size: int, gpus_per_rank: float = 0.0, cpus_per_rank: float = 1.0, *, replica_cpus: float = 0.0
) -> list[dict[str, float]]:
    """One bundle per rank (`{"CPU": c, "GPU": g}`, zero entries left out); bundle 0 adds `replica_cpus`."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if gpus_per_rank < 0 or cpus_per_rank < 0 or replica_cpus < 0:
        raise ValueError("resources per rank must be non-negative")
    bundles = []
    for rank in range(group_size):
        bundle: dict[str, float] = {}
        cpus = cpus_per_rank + (replica_cpus if rank == 0 else 0.0)
        if cpus > 0:
            bundle["CPU"] = float(cpus)
        if gpus_per_rank > 0:
            bundle["GPU"] = float(gpus_per_rank)
        if not bundle:
            raise ValueError("a bundle needs some resources: give cpus_per_rank or gpus_per_rank")
        bundles.append(bundle)
    return bundles


def deployment_options(
    group_size: int,
    gpus_per_rank: float = 0.0,
    cpus_per_rank: float = 1.0,
    *,
    replica_cpus: float = 0.0,
    strategy: Strategy = "STRICT_PACK",
) -> dict[str, Any]:
    """`serve.deployment(...)` keyword arguments that give each replica its group's placement group."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return {
        "placement_group_bundles": placement_bundles(
            group_size, gpus_per_rank, cpus_per_rank, replica_cpus=replica_cpus
        ),
        "placement_group_strategy": strategy,
        "ray_actor_options": {"num_cpus": replica_cpus, "num_gpus": 0},
    }


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class RankWorker:
    """One rank of a group: an actor in its bundle that joins the group's `torch.distributed`
    process group."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.use_gpu = use_gpu
        self.joined = False

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: the group's rendezvous when this is rank 0."""
        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def placement(self) -> dict[str, Any]:
        """Where this worker runs: node id, placement group id and the resources assigned to it."""
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "resources": ctx.get_assigned_resources(),
            "captures_child_tasks": ctx.should_capture_child_tasks_in_placement_group,
            "gpu_ids": ray.get_gpu_ids(),
        }

    def join(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> int:
        """`init_process_group` at `tcp://master_addr:master_port`; returns this rank."""
        import torch
        import torch.distributed as dist

        if self.use_gpu:
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU(s)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.joined = True
        return self.rank

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum `values` over the group (on this rank's GPU under NCCL)."""
        import torch
        import torch.distributed as dist

        device = "cuda" if self.use_gpu else "cpu"
        tensor = torch.tensor(values, dtype=torch.float32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.cpu().tolist()

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(worker, *args, **kwargs)` on this rank (the hook for parallel compute)."""
        return fn(self, *args, **kwargs)

    def leave(self) -> None:
        import torch.distributed as dist

        if self.joined and dist.is_initialized():
            dist.destroy_process_group()
        self.joined = False


class RankGroup:
    """Start, check and stop the `RankWorker`s of one replica's group; see the module docstring.

    `placement_group=None` uses the current placement group (the replica's); outside one
    (a script, a test) it creates a group of `placement_bundles(...)` with `strategy` and
    removes it at shutdown. Rank r goes to bundle `first_bundle + r`.
    """

    def __init__(
        self,
        size: int,
        *,
        gpus_per_rank: float = 0.0,
        cpus_per_rank: float = 1.0,
        backend: str | None = None,
        placement_group: PlacementGroup | None = None,
        strategy: Strategy = "STRICT_PACK",
        first_bundle: int = 0,
        timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self.size = size
        self.gpus_per_rank = gpus_per_rank
        self.cpus_per_rank = cpus_per_rank
        self.backend = backend or ("nccl" if gpus_per_rank > 0 else "gloo")
        self.strategy = strategy
        self.first_bundle = first_bundle
        self.timeout_s = timeout_s
        self._pg = placement_group
        self._owns_pg = False
        self.workers: list[Any] = []
        self.address: tuple[str, int] | None = None

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self._pg

    def _resolve_pg(self) -> PlacementGroup:
        if self._pg is None:
            self._pg = get_current_placement_group()
        if self._pg is None:
            bundles = placement_bundles(self.size, self.gpus_per_rank, self.cpus_per_rank)
            self._pg = placement_group(bundles, strategy=self.strategy)
            self._owns_pg = True
        return self._pg

    def _spawn(self) -> list[Any]:
        pg = self._resolve_pg()
        actor = ray.remote(RankWorker)
        use_gpu = self.gpus_per_rank > 0
        self.workers = [
            actor.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=self.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=self.first_bundle + rank,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote(rank, self.size, use_gpu)
            for rank in range(self.size)
        ]
        return self.workers

    def _join_refs(self, address: tuple[str, int]) -> list[Any]:
        self.address = address
        host, port = address
        return [w.join.remote(host, port, self.backend, self.timeout_s) for w in self.workers]

    def start(self) -> RankGroup:
        """Start the workers and join them into one process group (blocking: for a replica's
        constructor or a script)."""
        self._spawn()
        try:
            if self._owns_pg:
                ray.get(self._pg.ready(), timeout=self.timeout_s)  # type: ignore[union-attr]
            address = ray.get(self.workers[0].address.remote(), timeout=self.timeout_s)
            ray.get(self._join_refs(address), timeout=self.timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self

    async def start_async(self) -> RankGroup:
        """`start` for an event loop (an async replica constructor): awaits instead of blocking."""
        self._spawn()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._owns_pg:
                    await self._pg.ready()  # type: ignore[union-attr]
                address = await self.workers[0].address.remote()
                await asyncio.gather(*self._join_refs(tuple(address)))
        except BaseException:
            self.shutdown()
            raise
        return self

    def check(self, length: int = 4) -> bool:
        """All-reduce sanity check: rank r contributes r + 1 in each of `length` slots."""
        refs = [w.all_reduce.remote([float(rank + 1)] * length) for rank, w in enumerate(self.workers)]
        results = ray.get(refs, timeout=self.timeout_s)
        expected = [float(self.size * (self.size + 1) // 2)] * length
        return all(r == expected for r in results)

    def placements(self) -> list[dict[str, Any]]:
        return ray.get([w.placement.remote() for w in self.workers], timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Leave the process group, kill the workers, and remove the placement group if this created it."""
        if self.workers:
            # A worker that never joined or already died is killed below anyway.
            with contextlib.suppress(Exception):
                ray.get([w.leave.remote() for w in self.workers], timeout=10)
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []
        if self._owns_pg and self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
            self._owns_pg = False
