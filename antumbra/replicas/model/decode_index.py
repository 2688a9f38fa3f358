"""The step metadata of a fixed-shape decode step, built on the device.

`StepIndex` (forward_batch.py) sizes its tensors from the step's host-side facts, so every step has
its own shapes. A decode batch padded to a fixed size and fixed widths (`DecodeShape`) has its index
built here by device ops from the block tables alone (`kernels/decode_index` states the rules), so a
step never waits for the host and can be captured once per batch size in a CUDA graph. The layers
read either index through `LayerStep` (step.py).

Invariants it relies on:
  * a padded row (`active == False`) reads no key and writes only scratch rows
    (`KVPools.scratch_swa_row`, `CompressorPool.scratch_row`), so it never disturbs a
    live sequence, and its logits are garbage the caller drops;
  * every active row's new token, window keys and closing window have SWA pages attached
    (the scheduler's guarantee for decodes without replay);
  * C_m entry rows are `slot // m` in both the main and the indexer pool of a CSA layer,
    so one candidate row index addresses both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import ModelConfig
from antumbra.kernels.decode_index.triton import rate_index, window_index

from .rope import RotaryTable


class ConfiguredModel(Protocol):
    config: ModelConfig


@dataclass(frozen=True)
class DecodeShape:
    """Static widths of a decode batch: rows, logical pages per row, entries per rate."""

    batch_size: int
    max_pages: int  # block-table width: ceil(max_model_len / page_size)
    max_entries: dict[int, int]  # rate m -> max_model_len // m

    @staticmethod
    def for_model(model: ConfiguredModel, batch_size: int, max_model_len: int, page_size: int) -> DecodeShape:
        cfg = model.config
        rates = {cfg.compress_rate(i) for i in range(cfg.num_layers)} - {0}
        return DecodeShape(
            batch_size, -(-max_model_len // page_size), {m: max_model_len // m for m in sorted(rates)}
        )


@dataclass(frozen=True)
class DecodeInputs:
    """Host-written inputs of one decode step (device tensors of a `DecodeShape`).

    Token ids, positions and the active flags are rows of one [3, B] int64 buffer, so the host
    sends them in a single copy."""

    packed: torch.Tensor  # [3, B] int64: token ids, positions, active (1) / padded (0)
    block_tables: torch.Tensor  # [B, P] int64 virtual page of each logical page, -1 past the end
    # HiSparse only: [B] int64 first row of each row's hot buffer in `HotBuffers.rows` (padded rows:
    # any buffer, they select nothing).
    hot_base: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return self.packed[0]  # [B] int64

    @property
    def positions(self) -> torch.Tensor:
        return self.packed[1]  # [B] int64: position of the token being decoded

    @property
    def active(self) -> torch.Tensor:
        return self.packed[2]  # [B] int64: 0 for padded rows

    @staticmethod
    def empty(shape: DecodeShape, device: torch.device, pin_memory: bool = False) -> DecodeInputs:
        b = shape.batch_size
        return DecodeInputs(
            packed=torch.zeros(3, b, dtype=torch.long, device=device, pin_memory=pin_memory),
            block_tables=torch.full(
                (b, shape.max_pages), -1, dtype=torch.long, device=device, pin_memory=pin_memory
            ),
        )

    def head(self, rows: int) -> DecodeInputs:
        """The first `rows` rows (views: a smaller captured graph reads the same buffers)."""
        hot_base = self.hot_base[:rows] if self.hot_base is not None else None
        return DecodeInputs(self.packed[:, :rows], self.block_tables[:rows], hot_base)


@dataclass(frozen=True)
class RateIndex:
    """Per compression rate m, for every row of the batch."""

    entry_rows: torch.Tensor  # [B, C_m] int32 pool row of entry w, -1 unless w < (pos + 1) // m
    num_entries: torch.Tensor  # [B] int32 causal entries (0 for padded rows)
    event_rows: torch.Tensor  # [B] int64 row the window closed by this token goes to (scratch if none)
    event_positions: torch.Tensor  # [B] int64 first position of that window
    event_cos: torch.Tensor  # [B, rope_dim / 2] float32 compress-rope cos at event_positions
    event_sin: torch.Tensor  # [B, rope_dim / 2] float32
    src_rows: torch.Tensor  # [B, m] int64 state rows of the window's tokens (scratch if none)
    prev_rows: torch.Tensor  # [B, m] int64 state rows of the previous window (scratch if none)
    has_prev: torch.Tensor  # [B] bool


@dataclass(frozen=True)
class DecodeIndex:
    new_swa_rows: torch.Tensor  # [B] int64 SWA / state row of the new token (scratch for padded rows)
    window_rows: torch.Tensor  # [B, W] int32 SWA rows of positions pos-W+1..pos, -1 = none
    rates: dict[int, RateIndex]
    hot_base: torch.Tensor | None = None  # HiSparse: DecodeInputs.hot_base


def build_decode_index(
    inp: DecodeInputs, pools: KVPools, window: int, shape: DecodeShape, compress_rope: RotaryTable
) -> DecodeIndex:
    """Everything the layers read, from the block tables and the device copy of the SWA table
    (`kernels/decode_index` states the rules; a row whose new token has no SWA page, a scheduler
    bug the runner checks on the host, writes the scratch row rather than out of bounds)."""
    page = pools.layout.page_size
    args = (inp.block_tables, pools.swa_page_of_vpage, inp.positions, inp.active, page)
    new_rows, window_rows = window_index(*args, window, pools.scratch_swa_row)
    rates = {}
    for m, width in shape.max_entries.items():
        entry_rows, num_entries, event_rows, event_first, src_rows, prev_rows, has_prev = rate_index(
            *args, m, width, pools.scratch_swa_row, _scratch_compressed_row(pools, m)
        )
        event_cos, event_sin = compress_rope.cos_sin(event_first)
        rates[m] = RateIndex(
            entry_rows=entry_rows,
            num_entries=num_entries,
            event_rows=event_rows,
            event_positions=event_first,
            event_cos=event_cos,
            event_sin=event_sin,
            src_rows=src_rows,
            prev_rows=prev_rows,
            has_prev=has_prev,
        )
    return DecodeIndex(new_rows, window_rows, rates, inp.hot_base)


def _scratch_compressed_row(pools: KVPools, rate: int) -> int:
    # All pools of one rate have the same number of rows, hence the same scratch row.
    for pool in list(pools.compressors.values()) + list(pools.indexers.values()):
        if pool.spec.rate == rate:
            return pool.scratch_row
    raise ValueError(f"no compressed pool of rate {rate}")
