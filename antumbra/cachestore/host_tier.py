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
