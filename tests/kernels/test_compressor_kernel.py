"""Fused compressor kernel vs its reference, and the reference vs the model's `WindowCompressor.compress`.

The kernel runs in the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET), so shapes
are small and irregular: head dims that are not powers of two, several channel tiles, windows whose
previous window is missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from antumbra.cachestore.row_format import RowFormat
from antumbra.config import RopeConfig
from antumbra.kernels.common.arrivals import arrival_counters
from antumbra.kernels.compressor import compress_reference, compress_windows
from antumbra.kernels.compressor import triton as compressor_triton
from antumbra.replicas.model.compressor import WindowCompressor
from antumbra.replicas.model.forward_batch import CompressedIndex
from antumbra.replicas.model.rope import RotaryTable


class _DevicePool(SimpleNamespace):
    """The pool fields the compressor reads, its rows on the device (no host tier): written in place,
    as `CompressorPool.write_rows` does without a writer."""

    on_host_tier = False

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.rows[rows] = values


def _nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _events(g: torch.Generator, rate: int, overlap: int, num_events: int, num_rows: int) -> dict:
    """Random, non-overlapping state rows per event (gathers must follow the row indices)."""
    perm = torch.randperm(num_rows, generator=g)
    src = perm[: num_events * rate].view(num_events, rate)
    if overlap == 2:
        prev = perm[num_events * rate : 2 * num_events * rate].view(num_events, rate)
        has_prev = torch.rand(num_events, generator=g) > 0.3
        has_prev[0] = False  # always cover window 0
    else:
        prev, has_prev = None, None
    return {"src_rows": src, "prev_rows": prev, "has_prev": has_prev}


@pytest.mark.parametrize(
    ("rate", "overlap", "head_dim", "rope_dim", "num_events", "split", "dtype"),
    [
        (4, 2, 40, 8, 5, 1, torch.float32),  # CSA: 8 slots with overlap, one program per event
        (4, 2, 40, 8, 4, 2, torch.bfloat16),  # CSA, channel-split with the last-arrival finish
        (128, 1, 24, 8, 2, 1, torch.float32),  # HCA: 128 slots, no overlap
        (16, 1, 48, 16, 3, 3, torch.float32),  # three channel tiles, last one partial
    ],
)
def test_kernel_matches_reference(rate, overlap, head_dim, rope_dim, num_events, split, dtype, monkeypatch):
    monkeypatch.setattr(compressor_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(rate * 1000 + head_dim * 10 + split)
    num_rows = 2 * num_events * rate + 3
    width = overlap * head_dim
    state_kv = torch.randn(num_rows, width, generator=g)
    state_gate = 2 * torch.randn(num_rows, width, generator=g)
    ev = _events(g, rate, overlap, num_events, num_rows)
    ape = torch.randn(rate, width, generator=g)
    norm_w = torch.rand(head_dim, generator=g) + 0.5
    cos = torch.randn(num_events, rope_dim // 2, generator=g)
    sin = torch.randn(num_events, rope_dim // 2, generator=g)
    pool_rows = num_events + 4
    out_rows = torch.randperm(pool_rows, generator=g)[:num_events]
    args = (state_kv, state_gate, ev["src_rows"], ev["prev_rows"], ev["has_prev"], ape, norm_w, 1e-6, cos,
            sin)

    out = torch.full((pool_rows, head_dim), float("nan"), dtype=dtype)
    compress_windows(*args, out, out_rows, split=split)
    ref = compress_reference(*args, torch.zeros(pool_rows, head_dim), out_rows)

    untouched = torch.ones(pool_rows, dtype=torch.bool)
    untouched[out_rows] = False
    assert out[untouched].isnan().all(), "kernel wrote outside out_rows"
    assert out[out_rows].isfinite().all(), "kernel left entries unwritten"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel_err(out[out_rows], ref[out_rows]) < tol
    # The finishing programs leave the stream's arrival counters at zero: the next call fills none.
    assert not arrival_counters(out.device, num_events).any()
    again = torch.full_like(out, float("nan"))
    compress_windows(*args, again, out_rows, split=split)
    assert torch.equal(again[out_rows], out[out_rows])


@pytest.mark.parametrize(("rate", "overlap"), [(4, 2), (128, 1)])
def test_reference_matches_model(rate, overlap):
    """Same state through the model's WindowCompressor.compress gives the reference's entries."""
    g = torch.Generator().manual_seed(rate)
    head_dim, rope_dim, num_events = 24, 8, 3
    comp = WindowCompressor(hidden_size=16, head_dim=head_dim, rate=rate, overlap=overlap, eps=1e-6)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(rate, overlap * head_dim, generator=g))
        comp.kv_norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    num_rows = 2 * num_events * rate
    pool = _DevicePool(
        state_kv=torch.randn(num_rows, overlap * head_dim, generator=g),
        state_gate=torch.randn(num_rows, overlap * head_dim, generator=g),
        rows=torch.zeros(num_events + 2, head_dim),
        row_format=RowFormat.plain(head_dim, torch.float32),
    )
    ev = _events(g, rate, overlap, num_events, num_rows)
    positions = torch.tensor([0, 5 * rate, 37 * rate])
    index = CompressedIndex(
        entry_rows=torch.zeros(1, 1, dtype=torch.long),
        entry_valid=torch.zeros(1, 1, dtype=torch.bool),
        event_tokens=torch.arange(num_events),
        event_rows=torch.tensor([2, 0, 4]),
        event_positions=positions,
        event_src_rows=ev["src_rows"],
        event_prev_rows=ev["prev_rows"] if overlap == 2 else torch.zeros_like(ev["src_rows"]),
        event_has_prev=ev["has_prev"] if overlap == 2 else torch.zeros(num_events, dtype=torch.bool),
    )
    rope = RotaryTable(RopeConfig(theta=160000.0, rope_dim=rope_dim), "cpu")
    comp.compress(index, pool, rope, torch.float32)

    cos, sin = rope.cos_sin(positions)
    ref = compress_reference(
        pool.state_kv, pool.state_gate, ev["src_rows"], ev["prev_rows"], ev["has_prev"],
        comp.position_bias.detach(), comp.kv_norm.weight.detach(), 1e-6, cos, sin,
        torch.zeros_like(pool.rows), index.event_rows,
    )
    torch.testing.assert_close(ref, pool.rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("rate", "overlap", "head_dim", "rope_dim", "split", "dtype", "code"),
    [
        (4, 2, 64, 16, 1, torch.float32, "fp8"),  # C4 entries, one program per event
        (4, 2, 64, 16, 2, torch.bfloat16, "fp8"),  # the last-arrival finish encodes
        (128, 1, 128, 32, 1, torch.bfloat16, "fp8"),  # C128 entries
        (4, 2, 32, 8, 1, torch.float32, "fp4"),  # indexer keys (the rope width is the compressor's)
        (4, 2, 32, 8, 2, torch.bfloat16, "fp4"),
    ],
)
def test_coded_entries_equal_the_store_kernels_of_the_staged_entries(
    rate, overlap, head_dim, rope_dim, split, dtype, code, monkeypatch
):
    """With `codes` one launch stages each entry in `out` and encodes it into the code pool: the
    staged entries equal the plain launch's, and the code rows equal `store_fp8_rows` /
    `store_fp4_keys` of them, bit for bit, padding included; other code rows are untouched."""
    from antumbra.kernels.kv_codes import triton as codecs
    from antumbra.replicas.model.kv_rows import fp4_keys, fp8_rows, index_row_format, kv_row_format
    from antumbra.replicas.model.numerics import RELEASE

    monkeypatch.setattr(compressor_triton, "_empty", _nan_empty)
    g = torch.Generator().manual_seed(head_dim + split + (7 if code == "fp4" else 0))
    num_events, width = 3, overlap * head_dim
    num_rows = 2 * num_events * rate + 3
    ev = _events(g, rate, overlap, num_events, num_rows)
    args = (torch.randn(num_rows, width, generator=g), 2 * torch.randn(num_rows, width, generator=g),
            ev["src_rows"], ev["prev_rows"], ev["has_prev"], torch.randn(rate, width, generator=g),
            torch.rand(head_dim, generator=g) + 0.5, 1e-6,
            torch.randn(num_events, rope_dim // 2, generator=g),
            torch.randn(num_events, rope_dim // 2, generator=g))
    if code == "fp8":
        fmt = kv_row_format(RELEASE, head_dim, rope_dim, dtype)
        layout, store = fp8_rows(fmt, rope_dim), codecs.store_fp8_rows
    else:
        fmt = index_row_format(RELEASE, head_dim, dtype)
        layout, store = fp4_keys(fmt), codecs.store_fp4_keys
    assert layout is not None
    stage_rows = torch.arange(num_events)
    code_rows = torch.tensor([5, 0, 2])
    staged = torch.full((num_events, head_dim), float("nan"), dtype=dtype)
    pool = torch.full((7, fmt.width), 0xAB, dtype=torch.uint8)  # poisoned: every byte must be written
    compress_windows(*args, staged, stage_rows, split=split, codes=(pool, code_rows, layout))

    plain = torch.full((num_events, head_dim), float("nan"), dtype=dtype)
    compress_windows(*args, plain, stage_rows, split=split)
    assert torch.equal(staged, plain)
    want = torch.full_like(pool, 0xAB)
    store(plain, want, code_rows, layout)
    assert torch.equal(pool, want)
