"""DeepSeek-V4's multi-token-prediction (MTP) draft block.

The release's `mtp.{i}.*` tensors describe one extra decoder block (the official `MTPBlock`): a full
V4 block whose attention is sliding-window only (its `compress_ratios` entry is 0) and whose MoE is
score-routed, with its own hyper-connection parameters, plus

    x = e_proj(enorm(embed(ids))) + h_proj(hnorm(h))            (e broadcast over the n streams)
    streams = Block(x);  logits = head(norm(hc_head(streams)))

where `h` is the target's last-layer residual streams `[T, n, D]` before its `hc_head`, and `embed`
and `head` are the target's own. At position i the block reads the target's state h_i and the
embedding of token i+1 and predicts token i+2; its attention runs at the target's positions.

The block is the target's `DecoderLayer` itself (attention, MoE, mHC), built from a one-layer view of
the model config (`mtp_config`): there is no second layer implementation.

Chaining for k > 1 drafts: draft step j >= 2 feeds the block's own output streams of step j - 1 as
`h` (with the token drafted at step j - 1), reusing the one block the release ships for every step.
The serving engines that draft several tokens with DeepSeek's single MTP layer do the same (vLLM's
MTP proposer, SGLang's EAGLE-style worker over the MTP layer, TensorRT-LLM's "MTP Eagle" mode): the
target's state at a drafted position does not exist until the target verifies it, and the block's
output lives in the same residual space as the target's last layer, which is what h_proj reads.

The block's sliding-window KV lives in `MTPWindowCache`, a per-sequence ring of rows owned by the
caller of the block (the engine will later hand the draft layer pages of its own pool instead).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from antumbra.cachestore.pools import KVPools, PoolLayout
from antumbra.config import SCORE_MOE, SLIDING, ModelConfig

from .decode_index import DecodeIndex
from .forward_batch import LONG_SPAN_TOKENS, StepIndex, WindowIndex
from .hyper_connections import HyperHead
from .model import DecoderLayer, DeepseekV4
from .norms import RMSNorm
from .numerics import Numerics


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer config the MTP block's `DecoderLayer` is built from: a sliding-window layer
    with a score-routed MoE, every other size the target's."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=(SLIDING,), mlp_layer_types=(SCORE_MOE,),
                               num_mtp_layers=0)


class MTPWindowCache:
    """The MTP block's sliding-window KV for `num_seqs` sequences.

    Sequence b owns rows [b * R, (b + 1) * R) of a one-layer `KVPools` (`swa_kv[0]`: [B * R + 1,
    width] in the pools' row format, the model dtype unless `kv_format` says otherwise); position p
    lives in row b * R + p % R, with R = window + max_chunk_tokens, so the keys a chunk's first query
    reads are never overwritten by the chunk's own later tokens. A position written again (a draft
    position the target verified, recomputed with the target's state) replaces its row, which is the
    whole rollback a rejected draft needs: a query at p reads only positions <= p, all of which the
    caller has (re)written by then.
    """

    def __init__(self, cfg: ModelConfig, num_seqs: int, max_chunk_tokens: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.window = cfg.sliding_window
        self.max_chunk_tokens = max_chunk_tokens
        self.rows_per_seq = cfg.sliding_window + max_chunk_tokens
        self.num_seqs = num_seqs
        layout = PoolLayout(page_size=self.rows_per_seq, window=cfg.sliding_window,
                            num_virtual_pages=num_seqs,
                            num_swa_pages=num_seqs, num_layers=1, head_dim=cfg.head_dim,
                            index_head_dim=cfg.index_head_dim, compressors=(), indexers=())
        self.pools = KVPools(layout, dtype, device)

    def step_index(self, starts: list[int], length: int) -> tuple[StepIndex, torch.Tensor]:
        """Every sequence's chunk of `length` tokens from position starts[b] -> (the step's index into
        the ring, positions [B * length] int64), tokens flattened sequence by sequence."""
        if len(starts) != self.num_seqs:
            raise ValueError(f"{len(starts)} starts for a cache of {self.num_seqs} sequences")
        return self.ragged_index(list(range(self.num_seqs)), starts, [length] * self.num_seqs)

    def ragged_index(self, slots: list[int], starts: list[int], lengths: list[int]
                     ) -> tuple[StepIndex, torch.Tensor]:
        """Chunks of lengths[i] tokens from position starts[i] of the sequences in ring slots[i] ->
        (the step's index into the ring, positions [sum(lengths)] int64), tokens chunk by chunk."""
        if not all(0 <= s < self.num_seqs for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and below {self.num_seqs}")
        if not all(0 < n <= self.max_chunk_tokens for n in lengths):
            raise ValueError(f"chunks of {lengths} tokens; this cache takes 1..{self.max_chunk_tokens}")
        device = self.pools.device
        r = self.rows_per_seq
        pos_list = [p for start, n in zip(starts, lengths, strict=True) for p in range(start, start + n)]
        base_list = [slot * r for slot, n in zip(slots, lengths, strict=True) for _ in range(n)]
        pos = torch.tensor(pos_list, dtype=torch.long).to(device)  # [T]
        base = torch.tensor(base_list, dtype=torch.long).to(device)  # [T]
        back = torch.arange(self.window - 1, -1, -1, device=device)
        win_pos = pos[:, None] - back[None, :]  # [T, W]
        valid = win_pos >= 0
        rows = torch.where(valid, base[:, None] + win_pos.clamp(min=0) % r, 0)
        bounds = [0, *itertools.accumulate(lengths)]
        spans = tuple(zip(bounds[:-1], bounds[1:], strict=True))
        long = [i for i, n in enumerate(lengths) if n >= LONG_SPAN_TOKENS]
        short = [t for i, (r0, r1) in enumerate(spans) if i not in long for t in range(r0, r1)]
        index = StepIndex(
            new_swa_rows=base + pos % r,
            spans=spans,
            short_rows=torch.tensor(short, dtype=torch.long).to(device),
            long_spans=tuple(spans[i] for i in long),
            long_stops=tuple(starts[i] + lengths[i] for i in long),
            hot_buffers=(),
            window=WindowIndex(rows, valid),
            compressed={},
        )
        return index, pos

    def fixed_index(self, base: torch.Tensor, positions: torch.Tensor, active: torch.Tensor) -> DecodeIndex:
        """The index of a fixed-shape draft step (what a CUDA graph holds: device ops only): row t at
        position positions[t] of the sequence whose ring rows start at base[t] (slot * R); a row with
        active[t] False reads no key and writes only the scratch row. base, positions: [T] int64,
        active: [T] bool."""
        r = self.rows_per_seq
        back = torch.arange(self.window - 1, -1, -1, device=positions.device)
        win_pos = positions[:, None] - back[None, :]  # [T, W]
        valid = (win_pos >= 0) & active[:, None]
        window_rows = torch.where(valid, base[:, None] + win_pos.clamp(min=0) % r, -1).to(torch.int32)
        new_rows = torch.where(active, base + positions % r, self.pools.scratch_swa_row)
        return DecodeIndex(new_rows, window_rows, {})


@dataclass(frozen=True)
class MTPOutput:
    logits: torch.Tensor  # [B, S, V] float32
    streams: torch.Tensor  # [B, S, n, D] the block's output streams (the next draft step's h)


class MTPBlock(nn.Module):
    """One MTP block. Parameters (in-memory names): `layer.*` (a `DecoderLayer`), `e_proj`,
    `h_proj` ([D, D] linears), `enorm`, `hnorm`, `norm` (RMS norms) and `hc_head` (`hc_fn [n, nD]`,
    `hc_base [n]`, `hc_scale [1]`). Embedding and LM head are the target's, passed per call."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.config = cfg
        self.layer = DecoderLayer(mtp_config(cfg), 0)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def set_numerics(self, numerics: Numerics) -> None:
        """Run the block's layer in `numerics` (every module that carries a numerics mode, as
        `DeepseekV4.set_numerics` does for the target's layers); the target's own mode is its own."""
        for module in self.modules():
            if hasattr(type(module), "numerics"):
                module.numerics = numerics  # type: ignore[assignment]

    def forward(self, target: DeepseekV4, hidden: torch.Tensor, input_ids: torch.Tensor, starts: list[int],
                cache: MTPWindowCache) -> MTPOutput:
        """hidden: [B, S, n, D] the target's last-layer streams at positions starts[b] .. + S - 1 (or
        the previous draft step's output streams), input_ids: [B, S] int64 the token after each of
        those positions -> logits of the token two after each position, and the block's streams.
        Writes the chunk's keys into `cache` (B must be the cache's sequence count)."""
        b, s = input_ids.shape
        index, positions = cache.step_index(starts, s)
        logits, streams = self.run(target, hidden.reshape(b * s, *hidden.shape[2:]), input_ids.reshape(-1),
                                   index, positions, cache)
        return MTPOutput(logits.view(b, s, -1), streams.view(b, s, *streams.shape[1:]))

    def run(self, target: DeepseekV4, hidden: torch.Tensor, ids: torch.Tensor, index: StepIndex | DecodeIndex,
            positions: torch.Tensor, cache: MTPWindowCache, logits_rows: torch.Tensor | None = None,
            kernels: bool = False, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over tokens laid out by `index` (`MTPWindowCache.ragged_index`, or `fixed_index`
        for a fixed-shape step, which runs the kernels): hidden [T, n, D], ids [T] int64 the token
        after each position -> (logits [N, V] float32 at `logits_rows`, every row when None; the
        block's output streams [T, n, D]). `head`: the LM head to score with ([N, D] -> [N, V] float32;
        None: the target's)."""
        step = target.layer_step(index, cache.pools, positions, kernels=kernels)
        embedded = self.e_proj(self.enorm(target.model.embed_tokens(ids)))  # [T, D]
        streams = self.h_proj(self.hnorm(hidden)) + embedded[:, None, :]
        streams, _ = self.layer(streams, ids, step)
        head_in = streams if logits_rows is None else streams[logits_rows]
        return (head or target.logits)(self.norm(self.hc_head(head_in))), streams
