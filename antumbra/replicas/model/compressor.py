"""KV compressors and the lightning indexer, reading and writing the paged pools.

A compressor with rate m turns each closed window of m tokens into one entry:

    C_w = RMSNorm( sum_j softmax_j(gate_j + ape_j) * kv_j ),  RoPE at position w*m

with the softmax taken over the window's slots separately for every channel. With
overlap (CSA) each token projects two halves [Ca | Cb]; entry w reads Ca of window
w-1 and Cb of window w (2m slots; window -1 contributes nothing). A token's
projections wait in the compression-state rows of its SWA row until its window
closes, so a window may close in a later step (chunked prefill, decode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from antumbra.cachestore.pools import CompressorPool
from antumbra.cachestore.row_format import RowFormat
from antumbra.config import CSA, ModelConfig
from antumbra.kernels.compressor import write_state
from antumbra.kernels.compressor.triton import compress_windows, step_events
from antumbra.kernels.gemv import gemv, gemv_into, takes_gemv
from antumbra.kernels.indexer_topk.triton import indexer_topk

from .forward_batch import LONG_SPAN_TOKENS, CompressedIndex
from .kv_rows import decode_index, encode_index, encode_kv, fp4_keys
from .norms import RMSNorm
from .numerics import EXACT, Numerics
from .rope import RotaryTable, apply_rope


class WindowCompressor(nn.Module):
    numerics: Numerics = EXACT  # set model-wide by DeepseekV4.set_numerics

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rate = rate
        self.overlap = overlap
        width = overlap * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)

    def write_state(self, x: torch.Tensor, rows: torch.Tensor, pool: CompressorPool) -> None:
        """x: [T, D] normed block input; rows: [T] state rows of those tokens."""
        if takes_gemv(x, self.kv_proj.weight, self.gate_proj.weight):
            # One launch for both projections and their stores (each rounded to x's dtype, as the
            # linears return it, then widened): cuBLAS would take two GEMMs, their reduces and a store.
            weights = (self.kv_proj.weight, self.gate_proj.weight)
            gemv_into(x, weights, (pool.state_kv, pool.state_gate), rows=rows)
            return
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if kv.is_cuda and kv.dtype in (torch.bfloat16, torch.float32) and not kv.requires_grad:
            # One launch for the two casts and the two indexed stores (the chain's values bit for bit).
            write_state(kv, gate, rows, pool.state_kv, pool.state_gate)
            return
        pool.state_kv[rows] = kv.float()
        pool.state_gate[rows] = gate.float()

    def compress(
        self, index: CompressedIndex, pool: CompressorPool, rope: RotaryTable, dtype: torch.dtype,
        kernels: bool = False,
    ) -> torch.Tensor | None:
        """Close every window whose last token is in this step and store its entry (through the fused
        kernel when `kernels`, for plain pools).

        A pool on the HiSparse host tier gets its rows written through off the compute stream
        (`CompressorPool.write_rows`), and they are returned: [E, width] rows in event order, on the
        compute device, where the step's attention reads them. Other pools, or no window closed: None."""
        if index.event_tokens.numel() == 0:
            return None
        if kernels and pool.row_format.is_plain:
            if not pool.on_host_tier:
                self._compress_kernel(index, pool, rope)
                return None
            entries = torch.empty(index.event_rows.shape[0], self.head_dim, dtype=pool.rows.dtype,
                                  device=pool.state_kv.device)
            self._compress_kernel(index, pool, rope, entries)
            pool.write_rows(index.event_rows, entries)
            return entries
        d = self.head_dim
        ape = self.position_bias.float()  # [m, c*d]
        kv = pool.state_kv[index.event_src_rows]  # [E, m, c*d]
        gate = pool.state_gate[index.event_src_rows] + ape
        if self.overlap == 2:
            has_prev = index.event_has_prev[:, None, None]
            prev_kv = torch.where(has_prev, pool.state_kv[index.event_prev_rows][..., :d], 0.0)
            prev_gate = pool.state_gate[index.event_prev_rows][..., :d] + ape[:, :d]
            prev_gate = torch.where(has_prev, prev_gate, float("-inf"))
            kv = torch.cat([prev_kv, kv[..., d:]], dim=1)  # [E, 2m, d]
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        weights = torch.softmax(gate, dim=1)
        entries = self.kv_norm((kv * weights).sum(dim=1).to(dtype))
        cos, sin = rope.cos_sin(index.event_positions)
        stored = self._encode_entries(pool.row_format, apply_rope(entries, cos, sin), 2 * cos.shape[-1])
        pool.write_rows(index.event_rows, stored)
        return stored if pool.on_host_tier else None

    def _compress_kernel(
        self, index: CompressedIndex, pool: CompressorPool, rope: RotaryTable, out: torch.Tensor | None = None
    ) -> None:
        """out: [E, d] to hold the entries in event order instead of the pool."""
        cos, sin = rope.cos_sin(index.event_positions)
        out_rows = index.event_rows if out is None else torch.arange(out.shape[0], device=out.device)
        # How many windows close depends on where the step's tokens sit; the launch is planned on
        # the step's token count instead, so the compiled variant does not follow the data.
        self.store_windows(pool, index.event_src_rows, index.event_prev_rows, index.event_has_prev, cos, sin,
                           out_rows, step_events(index.entry_rows.shape[0], self.rate), out=out)

    def store_windows(
        self, pool: CompressorPool, src_rows, prev_rows, has_prev, cos, sin, out_rows,
        plan_events: int | None = None, out: torch.Tensor | None = None,
        codes: tuple[torch.Tensor, torch.Tensor, Any] | None = None,
    ) -> None:
        """Close E windows through the fused kernel (it stores the entries' values: plain pools, or
        `out`).

        src_rows, prev_rows: [E, m] state rows of each window and the previous one; has_prev: [E] bool;
        cos, sin: [E, rope_dim / 2] float32 at the windows' first positions; out_rows: [E] rows of
        `out` (default: the pool's rows); plan_events: the event count the launch is planned for
        (None: E, fixed in a fixed-shape step); out: [R, d] float entries instead of the pool;
        codes: (code pool, [E] its rows, kv_codes layout): the same launch also encodes each entry
        there (`compress_windows`)."""
        overlap = self.overlap == 2
        compress_windows(
            pool.state_kv, pool.state_gate, src_rows, prev_rows if overlap else None,
            has_prev if overlap else None, self.position_bias.float(), self.kv_norm.weight.float(),
            self.kv_norm.eps, cos, sin, pool.device_rows if out is None else out, out_rows,
            plan_events=plan_events, codes=codes,
        )

    def _encode_entries(self, fmt: RowFormat, entries: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """Finished main entries [E, d] (after RoPE) -> the pool rows [E, width] that store them."""
        return encode_kv(fmt, entries, rope_dim, self.numerics)


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> float32 [T, H] = weights_proj(x) / sqrt(H), the product in x's dtype."""
        scale = self.num_heads**-0.5
        if takes_gemv(x, self.weights_proj.weight):
            return gemv(x, self.weights_proj.weight, scale=scale, out_dtype=torch.float32)
        return self.weights_proj(x).float() * scale


class Indexer(WindowCompressor):
    """Lightning indexer: its own overlapping compressor at `index_head_dim`, plus scoring.

    score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . K[s]) / sqrt(index_head_dim),
    w = weights_proj(x) / sqrt(num_heads); the top `index_topk` causal entries win. In release
    numerics q and K are Hadamard-rotated and FP4-rounded, and K is stored that way (numerics.py).
    """

    def __init__(
        self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rate: int, topk: int,
        eps: float,
    ) -> None:
        super().__init__(hidden_size, head_dim, rate, 2, eps)
        self.num_heads = num_heads
        self.topk = topk
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden_size, num_heads)

    def _encode_entries(self, fmt: RowFormat, entries: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """Indexer keys are stored rotated (and FP4 in release numerics), like the queries."""
        return encode_index(fmt, entries, self.numerics)

    def select(
        self,
        x: torch.Tensor,
        q_in: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index: CompressedIndex,
        pool: CompressorPool,
        spans: tuple[tuple[int, int], ...],
        kernels: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_in: q_b's input (the q norm's output through `numerics.act`); spans: token rows
        [row0, row1) of each sequence in the step; kernels: score and pick in the fused kernels.

        -> (rows [T, k] of the chosen entries in the main compressed pool, valid [T, k])."""
        t = x.shape[0]
        q = self.q_b_proj(q_in).view(t, self.num_heads, self.head_dim)
        q = self.numerics.indexer(apply_rope(q, cos, sin)).float()
        head_weights = self.scorer.head_weights(x)  # [T, H]
        if kernels and pool.row_format.is_plain:
            return self._select_kernel(q, head_weights, index, pool)
        if all(row1 - row0 < LONG_SPAN_TOKENS for row0, row1 in spans):
            # Decodes: one batched gather of each token's candidate keys.
            keys = decode_index(pool.row_format, pool.rows[index.entry_rows]).float()  # [T, C, d]
            logits = F.relu(torch.einsum("thd,tcd->thc", q, keys)) * self.head_dim**-0.5
            scores = torch.einsum("thc,th->tc", logits, head_weights)
        else:
            scores = torch.full(index.entry_valid.shape, float("-inf"), device=x.device)  # [T, C]
            for (row0, row1), num_entries in zip(spans, index.span_entries, strict=True):
                # Every token of one sequence scores the same entries (those its last token reads,
                # a host-side count): one matmul per sequence.
                if num_entries == 0:
                    continue
                stored = pool.rows[index.entry_rows[row1 - 1, :num_entries]]
                keys = decode_index(pool.row_format, stored).float()  # [C_b, d]
                logits = F.relu(torch.matmul(q[row0:row1], keys.t())) * self.head_dim**-0.5  # [n, H, C_b]
                scores[row0:row1, :num_entries] = torch.einsum("thc,th->tc", logits, head_weights[row0:row1])
        scores = scores.masked_fill(~index.entry_valid, float("-inf"))
        k = min(self.topk, scores.shape[1])
        chosen = scores.topk(k, dim=-1).indices
        return index.entry_rows.gather(1, chosen), index.entry_valid.gather(1, chosen)

    def _select_kernel(
        self, q: torch.Tensor, head_weights: torch.Tensor, index: CompressedIndex, pool: CompressorPool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and top-k fused: no [T, H, C] logits tensor, which at long prefills is gigabytes.
        The counts let the kernels skip each row's entries past its causal prefix."""
        candidates = torch.where(index.entry_valid, index.entry_rows, -1).to(torch.int32)
        num_candidates = index.entry_valid.sum(dim=1).to(torch.int32)
        chosen = self.top_rows(q, head_weights, pool, candidates, num_candidates).long()
        valid = chosen >= 0
        return torch.where(valid, chosen, 0), valid

    def top_rows(
        self, q: torch.Tensor, head_weights: torch.Tensor, pool: CompressorPool, candidates: torch.Tensor,
        num_candidates: torch.Tensor,
    ) -> torch.Tensor:
        """q: [T, H, d] (rotated); head_weights: [T, H] float32 (num_heads^-0.5 included); candidates:
        [T, C] int32 pool rows (-1 none); num_candidates: [T] int32 -> [T, k] int32 chosen rows, -1 padded."""
        k = min(self.topk, candidates.shape[1])
        if k == 0:  # no window closed yet in any of the step's sequences: nothing to pick from
            return candidates.new_empty(candidates.shape[0], 0)
        coded = fp4_keys(pool.row_format)  # FP4 keys are decoded in the score kernel, to q's dtype
        q = q.to(pool.rows.dtype if coded is None else pool.row_format.value_dtype)
        return indexer_topk(q.contiguous(), head_weights.contiguous(), pool.rows, candidates, k,
                            num_candidates, self.head_dim**-0.5, fp4_keys=coded)


class Compressor(WindowCompressor):
    """The main compressor of a CSA / HCA layer; CSA layers also own the indexer."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        kind = cfg.layer_types[layer]
        rate = cfg.compress_rates[kind]
        super().__init__(cfg.hidden_size, cfg.head_dim, rate, 2 if kind == CSA else 1, cfg.rms_norm_eps)
        if kind == CSA:
            self.indexer = Indexer(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, rate, cfg.index_topk,
                cfg.rms_norm_eps,
            )
