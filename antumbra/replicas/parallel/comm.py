"""The process groups of one replica's ranks, as objects (no `torch.distributed` default group).

Each rank builds, from one TCP store that rank 0 hosts:
* `control`: gloo over all ranks, CPU tensors: rank 0's per-step broadcast of the batch;
* `world`: all ranks on the compute device (NCCL on CUDA, gloo on CPU): the MoE all-reduce;
* `tp`: the T ranks of this rank's tensor-parallel group on the device: the attention all-reduce.

The groups are plain `ProcessGroup` objects, so several replicas (or engines in one test
process) never share global state. Invariant kept by every caller: all ranks of a group issue
the same collectives in the same order (rank 0's broadcast decides what each step runs).

A collective that fails (a peer died: its sockets closed, or the timeout passed) raises
`RankLostError`, a `FatalEngineError`: the engine stops and every request fails with it.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FatalEngineError
from .spec import ShardSpec


class RankLostError(FatalEngineError):
    """A collective of the replica's rank group failed: a rank died or stopped answering."""


def _group(store: Any, prefix: str, rank: int, size: int, backend: str, timeout: timedelta) -> Any:
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class Collectives:
    """What the sharded model and the step broadcast call; counts time spent in collectives."""

    def __init__(self, spec: ShardSpec, host: str, port: int, device: torch.device, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.spec = spec
        self.device = device
        store = dist.TCPStore(host, port, spec.world_size, spec.rank == 0, timeout=timeout)
        self._store = store  # keep the store alive as long as the groups
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.control = _group(store, "control", spec.rank, spec.world_size, "gloo", timeout)
        self.world = _group(store, "world", spec.rank, spec.world_size, backend, timeout)
        tp_index = spec.ep_rank
        self.tp = _group(store, f"tp{tp_index}", spec.tp_rank, spec.tp_size, backend, timeout)
        self.seconds = 0.0  # spent in device collectives (all-reduces) since the last reset
        self.calls = 0

    def _run(self, what: str, work_fn: Any) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            work_fn().wait()  # captured into the decode graph: no host timing, no sync
            return
        start = time.perf_counter()
        try:
            work_fn().wait()
        except RuntimeError as exc:
            raise RankLostError(f"rank {self.spec.rank}: {what} failed ({exc})") from exc
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.seconds += time.perf_counter() - start
        self.calls += 1

    def all_reduce_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (any shape, on the device) in place over the tensor-parallel group."""
        if self.spec.tp_size > 1:
            self._run("the attention all-reduce", lambda: self.tp.allreduce([tensor]))
        return tensor

    def all_reduce_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over every rank (the MoE combine)."""
        if self.spec.world_size > 1:
            self._run("the MoE all-reduce", lambda: self.world.allreduce([tensor]))
        return tensor

    # ------------------------------------------------------------------ control plane
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled, two gloo broadcasts on CPU tensors)."""
        try:
            if self.spec.rank == 0:
                payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.long)
                self.control.broadcast(size, 0).wait()
                self.control.broadcast(payload, 0).wait()
                return obj
            size = torch.zeros(1, dtype=torch.long)
            self.control.broadcast(size, 0).wait()
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            self.control.broadcast(payload, 0).wait()
            return pickle.loads(payload.numpy().tobytes())
        except RuntimeError as exc:
            raise RankLostError(f"rank {self.spec.rank}: the step broadcast failed ({exc})") from exc

    def agree(self, ok: bool) -> bool:
        """True when every rank's `ok` is (one all-reduce over `control`: every rank calls it at
        the same point, e.g. after the broadcast that asked for it)."""
        failed = torch.tensor([0 if ok else 1], dtype=torch.long)
        try:
            self.control.allreduce([failed]).wait()
        except RuntimeError as exc:
            raise RankLostError(f"rank {self.spec.rank}: the agreement failed ({exc})") from exc
        return int(failed.item()) == 0

    def barrier(self) -> None:
        self.broadcast_object("barrier")


__all__ = ["Collectives", "RankLostError"]
