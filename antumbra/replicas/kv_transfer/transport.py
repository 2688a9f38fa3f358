"""How a `KVPayload` travels from the prefill process to the decode process.

The sender calls `send(payload)` and gets a small `TransferTicket` (picklable, a few hundred bytes:
the payload's metadata, and where its bytes are); the ticket goes to the receiver over the control
plane (a Ray call's return value), which calls `receive(ticket)` for the payload. The tensors
travel as one flat byte buffer (every tensor viewed as bytes, back to back), so a transfer is one
message whatever the number of layers:

* `RayObjectTransport`: the buffer goes into Ray's object store (`ray.put`); the receiver's
  `ray.get` pulls it from whichever node holds it. Works between any two Ray processes.
* `TorchDistTransport`: point-to-point `send` / `recv` in a `torch.distributed` process group
  both ends belong to (gloo between CPU processes, NCCL between GPU replicas); the sender's
  `send` posts the message and returns at once, the receiver's `recv` completes it. `wait_sent`
  returns when the bytes have left (the sender may then drop its copy).

A receiver that gets a ticket whose bytes are gone (the sender died, the object was lost) raises
`TransferFailed`; the decode side then cancels its reservation (adopt.py), so nothing is held.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from .payload import KVPayload


class TransferFailed(RuntimeError):
    """The payload's bytes could not be had; the receiver holds nothing of it."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # byte offset in the flat buffer
    nbytes: int


@dataclass(frozen=True)
class TransferTicket:
    transport: str
    header: KVPayload  # the payload without its tensors
    specs: tuple[TensorSpec, ...]
    nbytes: int
    where: Any  # an ObjectRef, or (source rank, tag)


def pack(payload: KVPayload) -> tuple[KVPayload, tuple[TensorSpec, ...], torch.Tensor]:
    """(header, specs, [nbytes] uint8 buffer on the tensors' device) of a payload."""
    specs, parts, offset = [], [], 0
    for name, tensor in payload.tensors.items():
        flat = (
            tensor.contiguous().view(-1).view(torch.uint8)
            if tensor.numel()
            else tensor.new_empty(0, dtype=torch.uint8)
        )
        specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, offset, flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    buffer = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return dataclasses.replace(payload, tensors={}), tuple(specs), buffer


def unpack(header: KVPayload, specs: tuple[TensorSpec, ...], buffer: torch.Tensor) -> KVPayload:
    tensors = {}
    for spec in specs:
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
        tensors[spec.name] = (
            raw.view(spec.dtype).view(spec.shape)
            if spec.nbytes
            else torch.empty(spec.shape, dtype=spec.dtype, device=buffer.device)
        )
    return dataclasses.replace(header, tensors=tensors)


class KVTransport(ABC):
    name: str

    @abstractmethod
    def send(self, payload: KVPayload) -> TransferTicket:
        """Start moving the payload's bytes; -> the ticket the receiver needs."""

    @abstractmethod
    def receive(self, ticket: TransferTicket) -> KVPayload:
        """The payload (CPU tensors, or on this end's device); raises TransferFailed."""


class RayObjectTransport(KVTransport):
    """Through Ray's object store: any two processes of one Ray cluster."""

    name = "ray"

    def send(self, payload: KVPayload) -> TransferTicket:
        import ray

        header, specs, buffer = pack(payload)
        ref = ray.put(buffer.cpu().numpy())
        return TransferTicket(self.name, header, specs, int(buffer.numel()), ref)

    def receive(self, ticket: TransferTicket, timeout_s: float = 60.0) -> KVPayload:
        import ray

        try:
            array = ray.get(ticket.where, timeout=timeout_s)
        except Exception as exc:  # owner died, object lost, timeout
            raise TransferFailed(f"the KV payload's object could not be fetched: {exc}") from exc
        return unpack(ticket.header, ticket.specs, torch.from_numpy(array.copy()))


class TorchDistTransport(KVTransport):
    """Point-to-point over a `torch.distributed` ProcessGroup (gloo / NCCL) joining the two ends.

    `group` is the ProcessGroup object (its own `send` / `recv`, so it need not be the default group);
    `rank` this end's rank in it; `peer` the rank it sends to. One transport per pair and direction."""

    name = "torch.distributed"

    def __init__(self, group: Any, rank: int, peer: int, device: torch.device | str = "cpu") -> None:
        self.group, self.rank, self.peer = group, rank, peer
        self.device = torch.device(device)
        self._tags = itertools.count(1)
        self._pending: list[Any] = []

    def send(self, payload: KVPayload) -> TransferTicket:
        header, specs, buffer = pack(payload)
        tag = next(self._tags)
        buffer = buffer.to(self.device)
        if buffer.numel():
            self._pending.append((self.group.send([buffer], self.peer, tag), buffer))
        return TransferTicket(self.name, header, specs, int(buffer.numel()), (self.rank, tag))

    def wait_sent(self) -> None:
        """Block until every posted send has completed."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def receive(self, ticket: TransferTicket) -> KVPayload:
        source, tag = ticket.where
        buffer = torch.empty(ticket.nbytes, dtype=torch.uint8, device=self.device)
        if ticket.nbytes:
            try:
                self.group.recv([buffer], source, tag).wait()
            except Exception as exc:  # the peer died or the group broke
                raise TransferFailed(f"receiving the KV payload from rank {source} failed: {exc}") from exc
        return unpack(ticket.header, ticket.specs, buffer)


__all__ = ["KVTransport", "RayObjectTransport", "TorchDistTransport", "TransferFailed", "TransferTicket"]
