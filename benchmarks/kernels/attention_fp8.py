"""Decode attention over FP8 KV rows (release numerics) against the same attention over bf16 rows.

The release step's attention has taken several times exact's (docs/performance.md). This times, at
V4-Flash shapes (64 heads x 512, 64 RoPE channels,
584-byte FP8 rows, window 128 plus the top-512 C4 rows or the C128 rows of a 4K context), each read
of the FP8 rows the kernel offers beside the plain bf16 kernel: the two-tile read
(`fp8_split_rope`, the default), the assembled tile, and chunked tiles. Every timed launch is
checked against `hybrid_attention_reference` on the decoded rows (bf16 tolerance 1e-2).

    python -m benchmarks run kernels --only attention_fp8 [--smoke]
"""

from __future__ import annotations

from typing import Any

import torch

from ..lib.checks import BF16_TOL, rel_err
from ..lib.context import Context
from ..lib.timing import time_us

VARIANTS: dict[str, dict[str, Any]] = {
    "two_tiles": {},
    "assembled": {"fp8_split_rope": False},
    "chunked_d64_dv128": {"block_k": 32, "block_d": 64, "block_dv": 128},
    "chunked_d64_dv256": {"block_k": 32, "block_d": 64, "block_dv": 256},
    "two_tiles_bk32": {"block_k": 32},
}


def _case(batch: int, extra: int, heads: int, head_dim: int, rope_dim: int, window: int, device: str,
          pool_rows: int, sets: int, seed: int) -> dict[str, Any]:
    from antumbra.replicas.model.kv_rows import decode_kv, encode_kv, fp8_rows, kv_row_format
    from antumbra.replicas.model.numerics import RELEASE

    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16
    fmt = kv_row_format(RELEASE, head_dim, rope_dim, dtype)
    values = (torch.randn(pool_rows, head_dim, generator=gen) * 0.5).to(dtype).to(device)
    coded = encode_kv(fmt, values, rope_dim, RELEASE).contiguous()
    plain = decode_kv(fmt, coded, rope_dim).contiguous()
    queries = [(torch.randn(batch, heads, head_dim, generator=gen) * 0.05).to(dtype).to(device)
               for _ in range(sets)]
    rows = [(torch.randint(0, pool_rows, (batch, window), generator=gen, dtype=torch.int32).to(device),
             torch.randint(0, pool_rows, (batch, extra), generator=gen, dtype=torch.int32).to(device))
            for _ in range(sets)]
    sinks = torch.randn(heads, generator=gen).to(device)
    return {"layout": fp8_rows(fmt, rope_dim), "coded": coded, "plain": plain, "queries": queries,
            "rows": rows, "sinks": sinks}


def _time_case(case: dict[str, Any], device: str) -> dict[str, Any]:
    """The bf16 kernel on the decoded rows, then each FP8 read of VARIANTS on the coded rows."""
    from antumbra.kernels.hybrid_attention import triton as kernels
    from antumbra.kernels.hybrid_attention.reference import hybrid_attention_reference

    (win, ext), sinks = case["rows"][0], case["sinks"]
    want = hybrid_attention_reference(case["queries"][0], case["plain"], win, case["plain"], ext, sinks)

    def timed(pool: torch.Tensor, config: Any, layout: Any) -> dict[str, Any]:
        out = kernels.hybrid_attention_decode(case["queries"][0], pool, win, pool, ext, sinks, config=config,
                                              fp8_rows=layout)
        err = rel_err(out, want)
        calls = [lambda q=q, r=r: kernels.hybrid_attention_decode(q, pool, r[0], pool, r[1], sinks,
                                                                   config=config, fp8_rows=layout)
                 for q, r in zip(case["queries"], case["rows"], strict=True)]
        return {"us": time_us(calls, device), "rel_err": err, "ok": err < BF16_TOL}

    row: dict[str, Any] = {"plain_bf16": _guarded(lambda: timed(case["plain"], kernels.DEFAULT_CONFIG, None))}
    for name, fields in VARIANTS.items():
        config = kernels.AttentionConfig(**fields)
        row[name] = _guarded(lambda c=config: timed(case["coded"], c, case["layout"]))
        base, us = row["plain_bf16"].get("us"), row[name].get("us")
        if base and us:
            row[name]["vs_plain"] = us / base
    return row


def run(ctx: Context) -> dict[str, Any]:
    device = ctx.device
    if ctx.smoke:
        heads, head_dim, rope_dim, window, pool_rows, sets = 4, 128, 32, 16, 512, 2
        cases = [(1, 32), (4, 8)]
    else:
        heads, head_dim, rope_dim, window, pool_rows, sets = 64, 512, 64, 128, 1 << 20, 4
        cases = [(1, 512), (1, 32), (32, 512), (32, 32)]
    shape = {"heads": heads, "head_dim": head_dim, "rope_dim": rope_dim, "window": window}
    result: dict[str, Any] = {"shape": shape, "rows": []}
    for batch, extra in cases:
        case = _case(batch, extra, heads, head_dim, rope_dim, window, device, pool_rows, sets, batch + extra)
        row = {"batch": batch, "extra": extra, "keys": window + extra, **_time_case(case, device)}
        result["rows"].append(row)
    return result


def _guarded(fn: Any) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # a variant that does not compile or fit is a result too
        return {"error": repr(exc)[:400]}
