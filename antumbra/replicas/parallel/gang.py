"""The ranks of one replica: rank 0 in this process, ranks 1..N-1 as Ray actors, one placement group.

Rank 0 is the process that builds the `Engine` (a Serve replica actor, a script, a test): it
keeps the scheduler, ShadowRadix, the pools' bookkeeping and the sampler, and runs its own
shard of every step in-process. Before each forward its model's pre-hook broadcasts the
step (`step.py`); the other ranks run the same forward on their shards.

Placement: inside a placement group (a Serve replica deployed with `placement_group_bundles`:
the replica actor runs in bundle 0), rank r goes to bundle r. Elsewhere this creates a group
of N bundles (STRICT_PACK GPU bundles on CUDA, CPU bundles on a CPU), reserves bundle 0 for
rank 0 (on CUDA a holder actor there tells rank 0 which GPU is its) and removes it at shutdown.
Workers are created by this process, so they are owned by it: when the replica actor dies
they die with it (Ray kills an owner's actors), and Serve's restart brings up a fresh gang.

Failure: a collective that fails raises `RankLostError` (a `FatalEngineError`) in rank 0's
step, so every request fails with it and `Engine.health` raises; `check` also raises when a
worker's loop has ended (its actor died) while the engine was idle.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from antumbra.config import EngineConfig, ModelConfig

from ..plan import ExecutionPlan
from ..weights import WeightUpdateError
from .comm import Collectives, RankLostError
from .spec import ShardSpec
from .step import CAPTURE_ALL, STOP, fixed_step, step_message
from .weight_sync import (
    Prepared,
    StagedUpdate,
    WeightSwap,
    prepare,
    rank_sources,
    stage_rank_weights,
    swap_in,
)

log = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class _GpuHolder:
    """Holds bundle 0's GPU for rank 0 (a process Ray did not place) and says which it is."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]


class RankGang:
    def __init__(self, spec: ShardSpec, config: EngineConfig, model_config: ModelConfig, layout: str,
                 cpus_per_rank: float = 1.0, timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.config = config
        self.model_config = model_config
        self.layout = layout
        self.cpus_per_rank = cpus_per_rank
        self.timeout_s = timeout_s
        self.on_cuda = torch.device(config.device).type == "cuda"
        self.workers: list[Any] = []
        self.comm: Collectives | None = None
        self._pg: Any = None
        self._owns_pg = False
        self._holder: Any = None
        self._loops: list[Any] = []
        self.loads: list[dict[str, int]] = []
        self._tokens = itertools.count(1)  # each live weight update stages under its own token
        self.stopped = False
        self.steps_sent = 0  # steps rank 0 broadcast; each worker counts the ones it ran

    # ------------------------------------------------------------------ start
    def start(self) -> RankGang:
        """Place and start the workers and join every rank (this one too) into the groups."""
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import RankWorker

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        n = self.spec.world_size
        gpus = 1.0 if self.on_cuda else 0.0
        self._pg = get_current_placement_group()
        if self._pg is None:
            bundle = {"GPU": 1.0, "CPU": self.cpus_per_rank} if self.on_cuda else {"CPU": self.cpus_per_rank}
            self._pg = placement_group([dict(bundle) for _ in range(n)],
                                       strategy="STRICT_PACK")
            self._owns_pg = True
            ray.get(self._pg.ready(), timeout=self.timeout_s)
        try:
            def where(bundle: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=bundle,
                    placement_group_capture_child_tasks=True)

            if self._owns_pg and self.on_cuda:
                holder = ray.remote(_GpuHolder).options(num_cpus=0, num_gpus=1, scheduling_strategy=where(0))
                self._holder = holder.remote()
                torch.cuda.set_device(ray.get(self._holder.gpu_ids.remote(), timeout=self.timeout_s)[0])
            actor = ray.remote(RankWorker)
            self.workers = [
                actor.options(num_cpus=self.cpus_per_rank, num_gpus=gpus, max_concurrency=3,
                              scheduling_strategy=where(rank)).remote(
                    self.spec.for_rank(rank), self.config, self.model_config, self.layout)
                for rank in range(1, n)
            ]
            host = ray.util.get_node_ip_address()
            port = _free_port(host)
            joins = [w.join.remote(host, port, self.timeout_s) for w in self.workers]
            device = torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device(
                "cpu")
            self.comm = Collectives(self.spec, host, port, device, self.timeout_s)
            ray.get(joins, timeout=self.timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self

    def load_workers(self, path: str) -> list[Any]:
        """Start every worker's shard load; -> refs to `ray.get` once rank 0 has loaded its own."""
        return [w.load.remote(str(path)) for w in self.workers]

    def serve(self, model: torch.nn.Module) -> None:
        """Start the workers' step loops and hook rank 0's model to broadcast each step."""
        self._loops = [w.serve.remote() for w in self.workers]
        comm = self.comm
        assert comm is not None

        def broadcast_step(module: torch.nn.Module, args: tuple) -> None:
            batch, pools = args[0], args[1]
            self.check()
            comm.broadcast_object(step_message(batch, pools))
            self.steps_sent += 1

        model.register_forward_pre_hook(broadcast_step)

    def serve_fixed(self, graphs: Any, pools: Any) -> None:
        """Hook rank 0's fixed-shape decode path (`decode_graphs.py`) to send each step's static
        inputs, and its start-up capture, to the other ranks."""
        comm = self.comm
        assert comm is not None

        def before_step(size: int, count: int) -> None:
            self.check()
            packed, tables = graphs.host_inputs(size)
            comm.broadcast_object(fixed_step(size, count, packed, tables, pools))
            self.steps_sent += 1

        graphs.before_step = before_step
        graphs.before_capture_all = lambda: comm.broadcast_object(CAPTURE_ALL)

    # ------------------------------------------------------------------ live weight updates
    def prepare_weights(self, model: torch.nn.Module, plan: ExecutionPlan,
                        source: str | Path | Mapping[str, torch.Tensor], version: str) -> StagedUpdate:
        """Phase 1 on every rank at once (`weight_sync.py` states the rule), rank 0 running
        `model`; the replica serves on meanwhile. Raises WeightUpdateError, naming each rank that
        failed, once every rank has dropped what it staged."""
        import ray

        self.check()
        comm = self.comm
        assert comm is not None
        cfg = self.model_config
        token = next(self._tokens)
        sources = rank_sources(source, cfg, self.spec)
        refs = [w.prepare_weights.remote(token, src)
                for w, src in zip(self.workers, sources[1:], strict=True)]
        mine, writes = prepare(0, lambda: stage_rank_weights(sources[0], model, cfg, self.spec, plan,
                                                             comm.device))
        answers = [mine]
        for rank, ref in enumerate(refs, start=1):
            try:
                answers.append(ray.get(ref, timeout=self.timeout_s * 10))
            except Exception as exc:  # the actor died, or its load outlived the timeout
                answers.append(Prepared(rank, f"no answer ({type(exc).__name__}: {exc})"))
        failed = [a for a in answers if a.error is not None]
        if failed:
            with contextlib.suppress(Exception):
                ray.get([w.drop_weights.remote(token) for w in self.workers], timeout=self.timeout_s)
            reasons = "; ".join(f"rank {a.rank}: {a.error}" for a in failed)
            raise WeightUpdateError(f"weights {version!r} refused by rank(s) {[a.rank for a in failed]}; "
                                    f"every rank keeps the weights it had. {reasons}")
        assert writes is not None
        return StagedUpdate(token, version, writes, sum(a.tensors for a in answers))

    def swap_weights(self, staged: StagedUpdate) -> int:
        """Phase 2, between two steps (the driver's update): every rank swaps in what it staged;
        -> the tensors written over all ranks. Raises RankLostError if any rank failed to swap."""
        comm = self.comm
        assert comm is not None
        self.check()
        comm.broadcast_object(WeightSwap(staged.token, staged.version))
        if not comm.agree(swap_in(staged.writes)):
            raise RankLostError(f"a rank failed to swap in weights {staged.version!r}: the ranks may hold "
                                "different weights, so the replica stops and must restart")
        return staged.tensors

    # ------------------------------------------------------------------ health and stop
    def dead_ranks(self) -> list[int]:
        """Ranks whose actor no longer answers (a quick ping each)."""
        import ray

        dead = []
        for rank, worker in enumerate(self.workers, start=1):
            try:
                ray.get(worker.pid.remote(), timeout=5)
            except Exception:
                dead.append(rank)
        return dead

    def check(self) -> None:
        """Raise RankLostError when a worker's step loop has ended (its actor died or failed)."""
        import ray

        if self.stopped:
            raise RankLostError("the rank gang was shut down")
        if not self._loops:
            return
        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        if done:
            ranks = [self._loops.index(ref) + 1 for ref in done]
            raise RankLostError(f"rank(s) {ranks} of the replica stopped; the replica must restart")

    def stats(self) -> list[dict[str, float]]:
        import ray

        return ray.get([w.stats.remote() for w in self.workers], timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Stop the workers' loops (if the group still works), kill them, release the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.comm is not None and self._loops and not self.stopped:
            with contextlib.suppress(Exception):
                done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
                if not done:
                    self.comm.broadcast_object(STOP)
                    ray.get(self._loops, timeout=10)
        self.stopped = True
        for worker in self.workers + ([self._holder] if self._holder is not None else []):
            with contextlib.suppress(Exception):
                ray.kill(worker)
        self.workers, self._holder = [], None
        if self._owns_pg and self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        self._pg = None


__all__ = ["RankGang"]
