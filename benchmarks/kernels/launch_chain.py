"""What a kernel boundary costs inside a CUDA graph, with and without programmatic dependent launch.

A decode step at batch 1 is a chain of a few hundred dependent launches, most of them small; on a
GPU each boundary costs the previous kernel's drain and the next one's launch. Hopper can overlap
them: a kernel launched with programmatic dependent launch (PDL) may start while its predecessor
finishes, and waits (`griddepcontrol.wait`) only where it reads the predecessor's output. This
times chains of N dependent kernels (each adds 1 to a small buffer, ping-ponging between two),
captured in a CUDA graph, per kernel:

- `plain`: ordinary launches;
- `pdl`: launched with PDL, each kernel waiting at its entry and releasing its dependent at once;
- `pdl_mixed`: the same with a torch op between every two kernels (a PDL kernel after a kernel that
  knows nothing of PDL, as the step's cuBLAS and torch kernels are);

at one program per kernel (the latency-bound decode kernels) and at one program per SM. Each chain's
result is checked against N additions. On a CPU (`--smoke`) the interpreter runs the plain chain
only (it cannot execute `griddepcontrol`).

    python -m benchmarks run kernels --only launch_chain [--smoke]
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..lib.context import Context
from ..lib.timing import time_us

WIDTH = 4096  # float32 elements a kernel touches: one program of 1024 threads x 4


def _chain(kernel, bufs: list[torch.Tensor], length: int, programs: int, pdl: bool, mixed: bool):
    n = bufs[0].numel()
    block = max(16, n // programs)

    def call() -> None:
        for i in range(length):
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
            if mixed and i % 2:
                torch.add(src, 1.0, out=dst)
            else:
                kernel[(programs,)](src, dst, n, PDL=pdl, BLOCK=block, launch_pdl=pdl)

    return call


def run(ctx: Context) -> dict[str, Any]:
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .launch_chain_kernel import add_one_kernel as kernel  # after TRITON_INTERPRET is set
    length = 8 if smoke else 256
    sms = torch.cuda.get_device_properties(device).multi_processor_count if ctx.on_gpu else 2
    variants = [("plain", False, False)] + ([("pdl", True, False), ("pdl_mixed", True, True),
                                            ("plain_mixed", False, True)] if ctx.on_gpu else [])
    rows, ok = [], True
    for programs in (1, sms):
        width = WIDTH if programs == 1 else WIDTH * programs
        for name, pdl, mixed in variants:
            bufs = [torch.zeros(width, device=device), torch.zeros(width, device=device)]
            call = _chain(kernel, bufs, length, programs, pdl, mixed)
            call()
            if ctx.on_gpu:
                torch.cuda.synchronize()
            passed = bool((bufs[length % 2] == length).all())
            ok &= passed
            us = time_us([call], device, reps=3 if smoke else 20) / length
            rows.append({"programs": programs, "variant": name, "us_per_kernel": us, "ok": passed})
    out: dict[str, Any] = {"benchmark": "kernel_launch_chain", "smoke": smoke, "chain_length": length,
                           "all_checks_ok": ok, "rows": rows}
    by = {(r["programs"], r["variant"]): r["us_per_kernel"] for r in rows}
    if ctx.on_gpu:
        for programs, tag in ((1, "1_program"), (sms, "sm_programs")):
            out[f"pdl_vs_plain_boundary_{tag}"] = by[(programs, "pdl")] / by[(programs, "plain")]
            mixed_ratio = by[(programs, "pdl_mixed")] / by[(programs, "plain_mixed")]
            out[f"pdl_mixed_vs_plain_mixed_{tag}"] = mixed_ratio
    return out


HEADLINE_PREFIXES = ("pdl_vs_plain_boundary_",)
