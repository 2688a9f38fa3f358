"""RMS norm and rope (alone and fused with the q / kv norms) vs the PyTorch chains they replace.

V4-Flash decode shapes: the block-input norm over hidden 4096, the query of 64 heads x 512
channels with the per-head norm and rope on the last 64, the latent KV row of 512 with its
weighted norm and rope, and the de-rotation of the attention output; T = 1, 8, 64 tokens.
Correctness against the references in float32 on fresh random bf16 inputs with poisoned
outputs, then median times (CUDA graphs over 16 rotating input sets) of kernel and chain.

    python -m benchmarks run kernels --only norm_rope [--smoke]
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..lib.checks import BF16_TOL, poisoned, rel_err
from ..lib.context import Context
from ..lib.timing import time_us


def _cases(smoke: bool) -> list[dict[str, Any]]:
    hidden, heads, head_dim, rope_dim = (64, 4, 32, 8) if smoke else (4096, 64, 512, 64)
    tokens = [1, 3] if smoke else [1, 8, 64]
    out = []
    for t in tokens:
        out += [
            {"op": "rms_norm", "tokens": t, "shape": (t, hidden)},
            {"op": "q_norm_rope", "tokens": t, "shape": (t, heads, head_dim), "rope_dim": rope_dim},
            {"op": "kv_norm_rope", "tokens": t, "shape": (t, head_dim), "rope_dim": rope_dim},
            {"op": "derotate", "tokens": t, "shape": (t, heads, head_dim), "rope_dim": rope_dim},
        ]
    return out


def _fns(case: dict[str, Any], device: str, g: torch.Generator):
    """-> (kernel call, reference call (float32 math), torch chain call) over fresh inputs."""
    from antumbra.kernels.rms_norm import rms_norm, rms_norm_reference
    from antumbra.kernels.rope import rope, rope_reference
    from antumbra.replicas.model.norms import RMSNorm, unweighted_rms_norm
    from antumbra.replicas.model.rope import apply_rope

    shape, eps = case["shape"], 1e-6
    x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    d = shape[-1]
    weight = torch.rand(d, device=device, generator=g) + 0.5
    if case["op"] == "rms_norm":

        def chain() -> torch.Tensor:  # the model's norm without the kernel: upcast, norm, downcast
            return torch.nn.functional.rms_norm(x.float(), (d,), weight, eps).to(x.dtype)

        return (
            functools.partial(rms_norm, x, weight, eps),
            functools.partial(rms_norm_reference, x.float(), weight, eps),
            chain,
        )
    angles = torch.rand(shape[0], case["rope_dim"] // 2, device=device, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    x3 = x.view(shape[0], -1, d)
    if case["op"] == "q_norm_rope":
        return (functools.partial(rope, x, cos, sin, norm_eps=eps),
                lambda: rope_reference(x3.float(), cos, sin, norm_eps=eps).view(shape),
                lambda: apply_rope(unweighted_rms_norm(x, eps), cos, sin))
    if case["op"] == "kv_norm_rope":
        norm = RMSNorm(d, eps).to(device)
        norm.weight.data.copy_(weight)
        return (functools.partial(rope, x, cos, sin, norm_eps=eps, norm_weight=weight),
                lambda: rope_reference(x3.float(), cos, sin, norm_eps=eps, norm_weight=weight).view(shape),
                lambda: apply_rope(norm(x), cos, sin))
    return (functools.partial(rope, x, cos, sin, inverse=True),
            lambda: rope_reference(x3.float(), cos, sin, inverse=True).view(shape),
            lambda: apply_rope(x, cos, -sin))


def run(ctx: Context) -> dict[str, Any]:
    device, smoke = ctx.device, ctx.smoke
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from antumbra.kernels.rms_norm import triton as rms_triton
    from antumbra.kernels.rope import triton as rope_triton

    g = torch.Generator(device=device).manual_seed(0)
    rows, ok = [], True
    for case in _cases(smoke):
        kernel, reference, _ = _fns(case, device, g)
        with poisoned(rms_triton), poisoned(rope_triton):
            got = kernel()
        err = rel_err(got.float(), reference().float())
        passed = bool(err < BF16_TOL and not got.isnan().any())
        ok &= passed
        sets = [_fns(case, device, g) for _ in range(2 if smoke else 16)]
        kernel_us = time_us([s[0] for s in sets], device)
        chain_us = time_us([s[2] for s in sets], device)
        rows.append({**{k: v for k, v in case.items() if k != "shape"}, "shape": list(case["shape"]),
                     "rel_err": err, "ok": passed, "kernel_us": kernel_us, "chain_us": chain_us,
                     "speedup": chain_us / kernel_us})
    decode = [r["speedup"] for r in rows if r["tokens"] == 1]
    return {
        "benchmark": "kernel_norm_rope",
        "smoke": smoke,
        "all_checks_ok": ok,
        "cases": rows,
        "norm_rope_vs_torch_B1": min(decode) if decode else None,
    }


# The ratios this benchmark puts in its suite's `ratios` table.
HEADLINE = ("norm_rope_vs_torch_B1",)
