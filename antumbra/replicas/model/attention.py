"""Hybrid attention of one layer: a sliding window plus compressed entries, one softmax.

For a query at position p the keys are the window rows p-W+1..p (SWA pool) and,
per layer type, no compressed entries (sliding), the indexer's top-k of the C_m
entries (CSA) or all causal C_m entries (HCA). K = V (one latent head shared by
all query heads); a per-head sink logit joins the softmax and is dropped after.
The RoPE slice of the output is de-rotated at the query position, then the
grouped low-rank output projection mixes heads.

One `forward` serves every step: the projections, RoPE and the new key's store are shared, and the
step's index picks how the keys are gathered and attended (`LayerStep`): a host-built `StepIndex`
here (PyTorch, or one hybrid-attention launch with the kernels), a device-built `DecodeIndex` in
`fixed_attention.py`, the fixed-shape decode step a CUDA graph holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from antumbra.cachestore.pools import KVPools
from antumbra.config import CSA, HCA, SLIDING, ModelConfig
from antumbra.kernels.hybrid_attention.triton import hybrid_attention
from antumbra.kernels.kv_codes.triton import store_fp8_rows
from antumbra.kernels.rope.triton import rope as rotate

from . import fixed_attention
from .compressor import Compressor
from .decode_index import DecodeIndex
from .forward_batch import LONG_SPAN_TOKENS, StepIndex
from .fp8_linear import project_pair
from .hot_stage import stage_rows
from .kv_rows import decode_kv, encode_kv, fp8_rows
from .norms import RMSNorm, unweighted_rms_norm
from .numerics import EXACT, Numerics
from .rope import apply_rope
from .step import LayerStep, normed


class Attention(nn.Module):
    numerics: Numerics = EXACT  # set model-wide by DeepseekV4.set_numerics
    # Set on a tensor-parallel rank (replicas/parallel/): sums the output projection's partial
    # sums over the rank's group; every step ends in `project_out`.
    output_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.kind = cfg.layer_types[layer]
        self.rate = cfg.compress_rate(layer)
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.rope_dim = cfg.rope_dim
        self.o_groups = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        if self.kind != SLIDING:
            self.compressor = Compressor(cfg, layer)

    def forward(self, x: torch.Tensor, x_act: torch.Tensor, step: LayerStep) -> torch.Tensor:
        """x: [T, D] normed block input, x_act: its `numerics.act` -> [T, D]; writes the new keys,
        compression state and closed windows. Release numerics feed x_act to the FP8 linears (q_a,
        kv) and the q norm's rounded output to both q_b's; the compressors and the indexer head
        weights read x as it is."""
        t = x.shape[0]
        cos, sin = step.rope_for(self.kind)
        q_a, kv = project_pair(self.q_a_proj, self.kv_proj, x_act)
        _, q_in = normed(self.q_a_norm, q_a, self.numerics, step.kernels)
        index = step.index
        forked = None
        if step.side is not None and self.kind == CSA and isinstance(index, DecodeIndex):
            forked = fixed_attention.fork_indexer(self.compressor, self.layer, x, q_in, (cos, sin), index,
                                                  step.pools, step.side)
        q = self.q_b_proj(q_in).view(t, self.num_heads, self.head_dim)
        if step.kernels:  # the norms fused into the RoPE launch
            q = rotate(q, cos, sin, norm_eps=self.eps)
            self._rotate_new_keys(kv, (cos, sin), step)
        else:
            q = apply_rope(unweighted_rms_norm(q, self.eps), cos, sin)
            self._store_new_keys(apply_rope(self.kv_norm(kv), cos, sin), step)  # [T, d]
        if isinstance(index, DecodeIndex):
            comp = getattr(self, "compressor", None)
            out = fixed_attention.attend(self.kind, self.layer, self.rope_dim, comp, self.sinks, q, x, q_in,
                                         (cos, sin), index, step.pools, forked, step.side)
            return self.project_out(rotate(out, cos, sin, inverse=True))
        return self.project_out(self._attend_general(q, x, q_in, step, index))

    def _rotate_new_keys(
        self, kv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: LayerStep
    ) -> None:
        """kv [T, d] before its norm -> normed and rotated by one launch, which writes each token's
        key straight into its SWA row where the pool keeps keys as they are (plain rows of the
        model dtype, no FP8 KV numerics); else stored by `_store_new_keys`."""
        swa = step.pools.swa_kv[self.layer]
        eps, weight = self.kv_norm.eps, self.kv_norm.weight.float()
        if step.pools.kv_format.is_plain and not self.numerics.kv_fp8 and swa.dtype == kv.dtype:
            rotate(kv, *rope, norm_eps=eps, norm_weight=weight, out=swa, out_rows=step.index.new_swa_rows)
        else:
            self._store_new_keys(rotate(kv, *rope, norm_eps=eps, norm_weight=weight), step)

    def _store_new_keys(self, kv: torch.Tensor, step: LayerStep) -> None:
        """Each token's key into its SWA row: encoded by one kernel launch with the kernels and a
        pool of codes, else by `encode_kv`."""
        pools = step.pools
        swa = pools.swa_kv[self.layer]  # [R, width] rows in the pools' KV format
        rows = step.index.new_swa_rows
        coded = fp8_rows(pools.kv_format, self.rope_dim) if step.kernels else None
        if coded is not None:
            store_fp8_rows(kv, swa, rows, coded)
        else:
            swa.index_copy_(0, rows, encode_kv(pools.kv_format, kv, self.rope_dim, self.numerics))

    def _attend_general(self, q, x, q_in, step: LayerStep, index: StepIndex) -> torch.Tensor:
        """The host-built index's attention: q [T, H, d] -> [T, H, d] de-rotated."""
        pools = step.pools
        cos, sin = step.rope_for(self.kind)
        swa = pools.swa_kv[self.layer]
        comp_rows = comp_valid = comp_pool = None
        if self.kind != SLIDING:
            comp_rows, comp_valid, comp_pool = self._compressed_rows(x, q_in, (cos, sin), step, index)
        if step.kernels and pools.kv_format.is_plain:
            out = self._attend_kernel(q.contiguous(), swa, index, comp_pool, comp_rows, comp_valid)
            return rotate(out, cos, sin, inverse=True)
        out = torch.empty_like(q)
        short = index.short_rows
        if short.numel():
            keys = [self._values(pools, swa[index.window.rows[short]])]  # [S, W, d]
            valid = [index.window.valid[short]]
            if comp_pool is not None and comp_rows is not None and comp_valid is not None:
                stored = comp_pool[comp_rows[short]]  # [S, K, width]
                keys.append(self._values(pools, stored))
                valid.append(comp_valid[short])
            out[short] = self._attend(q[short], keys, valid)
        for (row0, row1), stop in zip(index.long_spans, index.long_stops, strict=True):
            out[row0:row1] = self._attend_span(
                q, row0, row1, stop, swa, index, comp_rows, comp_valid, comp_pool, pools
            )
        return apply_rope(out, cos, -sin)

    def _values(self, pools: KVPools, rows: torch.Tensor) -> torch.Tensor:
        """Stored KV rows [..., width] -> their values [..., d] in the model dtype."""
        return decode_kv(pools.kv_format, rows, self.rope_dim)

    def _attend_kernel(self, q, swa, index: StepIndex, comp_pool, comp_rows, comp_valid) -> torch.Tensor:
        """Every query row (decode or prefill) in one hybrid-attention launch, reading the pools
        through row indices (-1 = no key). q: [T, H, d] -> [T, H, d]."""
        window = torch.where(index.window.valid, index.window.rows, -1).to(torch.int32)
        extra = None
        if comp_rows is not None and comp_valid is not None:
            extra = torch.where(comp_valid, comp_rows, -1).to(torch.int32)
        return hybrid_attention(q, swa, window, comp_pool, extra, self.sinks.float(), self.head_dim**-0.5)

    def _compressed_rows(self, x, q_in, cos_sin, step: LayerStep, index: StepIndex):
        """Update this layer's compressors, then -> (rows [T, K], valid [T, K], pool [R, width]): the
        compressed entries each query attends to, as rows of the pool they are read from.

        With HiSparse a CSA layer's pool is the host tier; the step reads the rows it picked from a
        device stage instead (`hot_stage.py`), and the rows returned are the stage's slots."""
        comp, pools, kernels = self.compressor, step.pools, step.kernels
        cidx = index.compressed[self.rate]
        pool = pools.compressors[self.layer]
        comp.write_state(x, index.new_swa_rows, pool)
        fresh = comp.compress(cidx, pool, step.compress_rope, x.dtype, kernels)
        if self.kind == HCA:
            return cidx.entry_rows, cidx.entry_valid, pool.rows
        ipool = pools.indexers[self.layer]
        comp.indexer.write_state(x, index.new_swa_rows, ipool)
        comp.indexer.compress(cidx, ipool, step.compress_rope, x.dtype, kernels)
        cos, sin = cos_sin
        rows, valid = comp.indexer.select(x, q_in, cos, sin, cidx, ipool, index.spans, kernels)
        if pools.hot is None:
            return rows, valid, pool.rows
        stage, slots = stage_rows(self.layer, pools, index.stage, index.spans, index.hot_buffers,
                                  index.short_rows, rows, valid, fresh, cidx.event_rows, LONG_SPAN_TOKENS)
        return slots, valid, stage

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor], valid: list[torch.Tensor]) -> torch.Tensor:
        """Per-query key sets. q: [T, H, d]; keys (= values): [T, K_i, d] with masks [T, K_i] -> [T, H, d].

        The kernel's precision: logits and softmax in float32, the probabilities rounded to the
        values' dtype before PV, which accumulates in float32 (bf16 logits would move a 4-layer
        slice's decode logprobs by tenths against the kernel)."""
        scale = self.head_dim**-0.5
        logits = [
            (torch.einsum("thd,tkd->thk", q.float(), k.float()) * scale).masked_fill(
                ~v[:, None, :], float("-inf")
            )
            for k, v in zip(keys, valid, strict=True)
        ]
        probs = self._softmax_with_sink(logits)
        out = sum(
            torch.einsum("thk,tkd->thd", _rounded_like(p, k), k.float())
            for p, k in zip(probs, keys, strict=True)
        )
        return out.to(q.dtype)  # type: ignore[union-attr]

    def _attend_span(
        self, q, row0, row1, stop, swa, index, comp_rows, comp_valid, comp_pool, pools, block: int = 64
    ):
        """All queries of one sequence's chunk, in blocks of queries sharing one key window.

        The chunk covers positions s..s+n-1 (`stop` = s+n, a host int); its window keys are
        positions s-W+1..s+n-1, gathered once. Query j reads window keys j..j+W-1 of that run (a
        band), plus its compressed keys: per-query top-k rows (CSA) or the sequence's causal
        entries (HCA).
        """
        scale = self.head_dim**-0.5
        window = index.window.rows.shape[1]
        n = row1 - row0
        run_rows = torch.cat([index.window.rows[row0, :-1], index.new_swa_rows[row0:row1]])
        run_valid = torch.cat([index.window.valid[row0, :-1], index.window.valid.new_ones(n)])
        run_keys = self._values(pools, swa[run_rows]).to(q.dtype)  # [W-1+n, d]
        shared = None
        if self.kind == HCA:
            num_entries = stop // self.rate  # the HCA entries the chunk's last query reads
            stored = comp_pool[comp_rows[row1 - 1, :num_entries].to(comp_pool.device)].to(q.device)
            shared = self._values(pools, stored).to(q.dtype)
        out = torch.empty(n, *q.shape[1:], dtype=q.dtype, device=q.device)
        for j0 in range(0, n, block):
            j1 = min(n, j0 + block)
            qb = q[row0 + j0 : row0 + j1]
            keys = run_keys[j0 : j1 + window - 1]
            rel = (
                torch.arange(keys.shape[0], device=q.device)[None, :]
                - torch.arange(j1 - j0, device=q.device)[:, None]
            )
            band = (rel >= 0) & (rel < window) & run_valid[j0 : j1 + window - 1][None, :]
            logits = [
                (torch.einsum("bhd,kd->bhk", qb.float(), keys.float()) * scale).masked_fill(
                    ~band[:, None, :], float("-inf")
                )
            ]
            values = [keys]
            if shared is not None:
                mask = comp_valid[row0 + j0 : row0 + j1, : shared.shape[0]]
                logits.append(
                    (torch.einsum("bhd,kd->bhk", qb.float(), shared.float()) * scale).masked_fill(
                        ~mask[:, None, :], float("-inf")
                    )
                )
                values.append(shared)
            elif comp_pool is not None:
                rows = comp_rows[row0 + j0 : row0 + j1].to(comp_pool.device)
                per_query = self._values(pools, comp_pool[rows].to(q.device)).to(q.dtype)  # [b, k, d]
                mask = comp_valid[row0 + j0 : row0 + j1]
                logits.append(
                    (torch.einsum("bhd,bkd->bhk", qb.float(), per_query.float()) * scale).masked_fill(
                        ~mask[:, None, :], float("-inf")
                    )
                )
                values.append(per_query)
            probs = self._softmax_with_sink(logits)
            parts = [
                torch.einsum("bhk,kd->bhd" if v.dim() == 2 else "bhk,bkd->bhd", _rounded_like(p, v),
                             v.float())
                for p, v in zip(probs, values, strict=True)
            ]
            out[j0:j1] = torch.stack(parts).sum(dim=0).to(out.dtype)
        return out

    def _softmax_with_sink(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """One float32 softmax over the concatenated key blocks [.., H, K_i] (float32 logits) plus
        the per-head sink, which is dropped."""
        t = logits[0].shape[0]
        sinks = self.sinks.float()[None, :, None].expand(t, -1, 1)
        combined = torch.cat([*logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)
        return list(probs.split([lg.shape[-1] for lg in logits] + [1], dim=-1)[:-1])

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank projection: per-group [H*d/g -> r], then [g*r -> D]."""
        t = out.shape[0]
        grouped = out.reshape(t, self.o_groups, -1)  # [T, g, H*d/g]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [g, r, H*d/g]
        mixed = torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, -1)
        projected = self.o_b_proj(self.numerics.act(mixed))
        return projected if self.output_reduce is None else self.output_reduce(projected)


def _rounded_like(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """float32 probabilities rounded to the values' dtype (as the kernel feeds PV), kept float32."""
    return probs.to(values.dtype).float()
