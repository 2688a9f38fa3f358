"""The HiSparse host tier as the device sees it: pinned host memory through its device address.

Pinned memory that torch allocates (`Tensor.pin_memory`, cudaHostAlloc underneath) is mapped into
the device's address space, and with unified addressing its device address is its host address.
A CUDA tensor aliasing it lets device kernels read and write the host tier directly (each access
a PCIe transfer), so a fixed-shape decode step captured in a CUDA graph can page rows in with no
host decision: `kernels/hot_gather` reads the selected rows, the fused compressor writes new
rows through. The host keeps using the CPU tensor itself (the general step's page-ins).
"""

from __future__ import annotations

import torch


class HostTierError(RuntimeError):
    """The host tier cannot be addressed from the device; the message says why."""


class _DeviceArray:
    """`__cuda_array_interface__` of a pinned byte tensor (kept alive while the alias lives)."""

    def __init__(self, host_bytes: torch.Tensor) -> None:
        self._host = host_bytes
        self.__cuda_array_interface__ = {
            "shape": tuple(host_bytes.shape),
            "typestr": "|u1",
            "data": (host_bytes.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def device_view(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`rows` as a tensor on `device`, sharing its memory (no copy): `rows` itself when it is there
    already or `device` is not a CUDA device; for a pinned CPU tensor a CUDA alias of it.

    rows: [N, W] contiguous, any dtype. Raises `HostTierError` when the memory is not
    device-mapped (not pinned, not contiguous, or the alias does not land on the same address)."""
    if rows.device == device or device.type != "cuda":
        return rows
    if rows.device.type != "cpu" or not rows.is_pinned():
        raise HostTierError(
            f"a host tier on {rows.device} (pinned: {rows.device.type == 'cpu' and rows.is_pinned()}) "
            f"cannot be read from {device}: HiSparse on the fixed-shape decode step needs pinned host rows"
        )
    if not rows.is_contiguous():
        raise HostTierError("the host tier must be one contiguous block to alias it on the device")
    with torch.cuda.device(device):
        alias = torch.as_tensor(_DeviceArray(rows.view(-1).view(torch.uint8)), device=device)
    if alias.data_ptr() != rows.data_ptr() or alias.device.type != "cuda":
        raise HostTierError(
            f"the device alias of the host tier is at {alias.data_ptr():#x} on {alias.device}, the rows at "
            f"{rows.data_ptr():#x}: this system does not map pinned memory at its host address"
        )
    return alias.view(rows.dtype).view(rows.shape)


class HostTierWriter:
    """Writes rows into host tiers off the compute stream, and orders their readers after them.

    A general step's compressors produce their new C4 rows on the device (the attention reads them
    there); `scatter` queues their copy into the host tier on a side stream, through the tier's
    device alias (one gather-free scatter kernel per layer and step, each row a PCIe write), after
    what the compute stream has queued so far, and returns at once. Invariant: a reader of a host
    tier on the compute stream calls `order_reads` first, and every general step calls it before it
    ends, so no later step, decode graph or host-side reader (after the step's outputs are read, or
    `settle`) sees a row before its write. Without CUDA the write happens at once and both calls do
    nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: torch.cuda.Event | None = None

    def scatter(self, tier: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """tier[rows] = values. tier: [R, W] the host tier as the compute device addresses it
        (`device_view`); rows: [E] int64 and values: [E, W] of tier's dtype, on that device."""
        if self.stream is None:
            tier.index_copy_(0, rows, values)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            wide_rows(tier).index_copy_(0, rows, wide_rows(values))
        # The side stream still reads both after the compute stream drops them.
        rows.record_stream(self.stream)
        values.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._pending = event

    def order_reads(self) -> None:
        """The compute stream waits for every write queued so far (no host wait)."""
        if self._pending is not None:
            self._pending.wait(torch.cuda.current_stream(self.device))
            self._pending = None

    def settle(self) -> None:
        """The host waits for every write queued so far (before it reads a host tier itself)."""
        if self.stream is not None:
            self.stream.synchronize()


def wide_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows: [N, W] contiguous -> the same bytes as [N, W'] of the widest integer type that divides a
    row, so that a gather or scatter of whole rows moves 8 bytes per element where it can."""
    row_bytes = rows.shape[-1] * rows.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0:
            return rows.view(torch.uint8).view(dtype) if rows.dtype != dtype else rows
    return rows.view(torch.uint8)
