"""The fixed-shape decode step: one token per row, every index built on the device.

`DeepseekV4.forward` serves any mix of prefill chunks and decodes, but it sizes tensors
from the data (the longest sequence, the windows that close this step) and so waits for
the device. This path takes a decode batch padded to a fixed size and fixed widths
(`DecodeShape`) and never leaves the device, so a step can be captured once per batch
size in a CUDA graph and replayed. It runs the Triton kernels: mHC pre/post, the fused
compressor, the indexer's scores + top-k, hybrid sparse attention and the MXFP4 MoE.

Invariants it relies on:
  * a padded row (`active == False`) reads no key and writes only scratch rows
    (`KVPools.scratch_swa_row`, `CompressorPool.scratch_row`), so it never disturbs a
    live sequence, and its logits are garbage the caller drops;
  * every active row's new token, window keys and closing window have SWA pages attached
    (the scheduler's guarantee for decodes without replay);
  * C_m entry rows are `slot // m` in both the main and the indexer pool of a CSA layer,
    so one candidate row index addresses both.

With HiSparse (`pools.hot`), the CSA layers' main rows live on the host tier: each CSA layer's
top-k rows are paged into the row's hot buffer on the device (`kernels/hot_gather`, on the side
stream with the indexer when there is one) and the attention reads the buffer through the
returned slots; the compressor writes closed windows through to the host tier. No step waits
for the host, so HiSparse decodes replay from CUDA graphs like the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import CSA, SLIDING
from antumbra.kernels.decode_index.triton import rate_index, window_index
from antumbra.kernels.hot_gather import gather_rows
from antumbra.kernels.hybrid_attention.triton import hybrid_attention_decode
from antumbra.kernels.kv_codes.triton import store_fp8_rows
from antumbra.kernels.mhc.triton import mhc_post, mhc_pre
from antumbra.kernels.rms_norm.triton import fuses_fp8, rms_norm_fp8
from antumbra.kernels.rope.triton import rope as rotate

from .attention import Attention
from .compressor import Indexer
from .hyper_connections import HyperConnection
from .kv_rows import fp4_keys, fp8_rows
from .model import DecoderLayer, DeepseekV4
from .moe import Experts, MoE
from .norms import RMSNorm
from .numerics import Numerics
from .packed_experts import PackedExperts
from .rope import RotaryTable


@dataclass(frozen=True)
class DecodeShape:
    """Static widths of a decode batch: rows, logical pages per row, entries per rate."""

    batch_size: int
    max_pages: int  # block-table width: ceil(max_model_len / page_size)
    max_entries: dict[int, int]  # rate m -> max_model_len // m

    @staticmethod
    def for_model(model: DeepseekV4, batch_size: int, max_model_len: int, page_size: int) -> DecodeShape:
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
    new_rows: torch.Tensor  # [B] int64 SWA / state row of the new token (scratch for padded rows)
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


@torch.no_grad()
def decode_step(
    model: DeepseekV4,
    inp: DecodeInputs,
    pools: KVPools,
    shape: DecodeShape,
    probe: torch.Tensor | None = None,
    side: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """One decode token per row -> logits [B, V] float32 (rows of padded inputs are garbage).

    probe: [B] int64, when given receives the SWA row each row's new token was written to,
    so a caller can check the device-built indices against the host's page tables.
    side: a second CUDA stream; when given, each CSA layer's indexer (its compressor, query,
    scores and top-k) runs on it, beside the main query, key and compressor work."""
    cfg = model.config
    if pools.hot is not None and inp.hot_base is None:
        raise ValueError("HiSparse pools: the decode inputs must name each row's hot buffer (hot_base)")
    ropes = model.rope_tables()
    index = build_decode_index(inp, pools, cfg.sliding_window, shape, ropes["compress"])
    if probe is not None:
        probe.copy_(index.new_rows)
    cos_sin = {name: table.cos_sin(inp.positions) for name, table in ropes.items()}
    streams = model.model.embed_tokens(inp.input_ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    layers: list[DecoderLayer] = list(model.model.layers)  # type: ignore[arg-type]
    for i, layer in enumerate(layers):
        kind = "main" if cfg.layer_types[i] == SLIDING else "compress"
        streams = _layer(layer, streams, inp.input_ids, cos_sin[kind], index, pools, side)
    hidden = model.model.norm(model.model.hc_head(streams))
    return model.logits(hidden)


def _layer(layer: DecoderLayer, streams, input_ids, cos_sin, index: DecodeIndex, pools, side) -> torch.Tensor:
    numerics = layer.self_attn.numerics
    collapsed, post, comb = _hc_pre(layer.attn_hc, streams)
    x, x_act = _normed(layer.input_layernorm, collapsed, numerics)
    attn_out = _attention(layer.self_attn, x, x_act, cos_sin, index, pools, side)
    streams = mhc_post(streams, attn_out.contiguous(), post, comb)
    collapsed, post, comb = _hc_pre(layer.ffn_hc, streams)
    x, x_act = _normed(layer.post_attention_layernorm, collapsed, numerics)
    mlp_out = _moe(layer.mlp, x, x_act, input_ids)
    return mhc_post(streams, mlp_out.contiguous(), post, comb)


def _normed(norm: RMSNorm, x: torch.Tensor, numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), numerics.act of it): release numerics feed the norm's output unrounded to the
    compressors, indexer weights and router, and FP8-rounded to the linears; on CUDA one launch
    makes both (`rms_norm_fp8`). Without activation rounding both are the same tensor."""
    if numerics.act_fp8 and x.is_cuda and fuses_fp8(x.shape[-1]):
        return rms_norm_fp8(x, norm.weight.float(), norm.eps)
    y = norm(x)
    return y, numerics.act(y)


def _moe(mlp: MoE, x: torch.Tensor, x_act: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """x: [B, D] the normed input, x_act: its `numerics.act` -> [B, D]. Dense experts run all
    experts on all rows: the grouped path sizes its work from the routing on the host, which a
    captured graph cannot. The packed routed and the shared experts share one rounded input."""
    fixed = getattr(mlp, "fixed_shape_forward", None)  # a rank's share of an expert-parallel MoE
    if fixed is not None:
        return fixed(x, input_ids)
    weights, indices = mlp.gate(x, input_ids)
    experts = mlp.experts
    if isinstance(experts, Experts):
        routed = experts._dense(x, weights, indices)
    elif isinstance(experts, PackedExperts):
        routed = experts.rounded_forward(x_act, weights, indices)
    else:
        routed = experts(x, weights, indices)
    return routed + mlp.shared_experts.rounded_forward(x_act)


def _hc_pre(hc: HyperConnection, streams: torch.Tensor):
    return mhc_pre(streams, hc.fn, hc.base, hc.scale, hc.iters, hc.hc_eps, hc.norm_eps)


def _attention(attn: Attention, x, x_act, cos_sin, index: DecodeIndex, pools: KVPools,
               side=None) -> torch.Tensor:
    """x: [B, D] normed block input, x_act: its `numerics.act` -> [B, D]; writes the new key,
    state rows and closed windows."""
    b = x.shape[0]
    cos, sin = cos_sin
    # Release numerics: the FP8 linears' inputs take FP8 round trips (fused with the norm before
    # them; x_act feeds q_a and kv, q_in both q_b's); the compressors and the indexer head weights
    # read x as it is.
    q_residual, q_in = _normed(attn.q_a_norm, attn.q_a_proj(x_act), attn.numerics)
    forked = None
    if side is not None and attn.kind == CSA:
        forked = _fork_indexer(attn, x, q_in, cos, sin, index, pools, side)
    q = attn.q_b_proj(q_in).view(b, attn.num_heads, attn.head_dim)
    q = rotate(q, cos, sin, norm_eps=attn.eps)  # the per-head q norm, fused
    kv = rotate(attn.kv_proj(x_act), cos, sin, norm_eps=attn.kv_norm.eps,
                norm_weight=attn.kv_norm.weight.float())
    swa = pools.swa_kv[attn.layer]
    coded = fp8_rows(pools.kv_format, attn.rope_dim)  # None: plain rows
    if coded is None:
        swa.index_copy_(0, index.new_rows, kv.to(swa.dtype))
    else:
        store_fp8_rows(kv, swa, index.new_rows, coded)
    extra_pool = extra_rows = None
    if attn.kind != SLIDING:
        ridx = index.rates[attn.rate]
        pool = pools.compressors[attn.layer]
        _compress(attn.compressor, x, index.new_rows, ridx, pool)
        extra_pool = pool.rows
        if attn.kind == CSA:
            rows = _join(forked, side) if forked is not None else _select(
                attn, x, q_in, cos, sin, index.new_rows, ridx, pools)
            extra_rows = _page_in(attn, rows, pools, index.hot_base)
            if pools.hot is not None:
                extra_pool = pools.hot.rows[attn.layer]  # extra_rows are slots of the hot buffers
        else:
            extra_rows = ridx.entry_rows
    out = hybrid_attention_decode(q, swa, index.window_rows, extra_pool, extra_rows, attn.sinks.float(),
                                  fp8_rows=coded)
    return attn._project_out(rotate(out, cos, sin, inverse=True))


def _fork_indexer(attn: Attention, x, q_in, cos, sin, index: DecodeIndex, pools, side) -> torch.Tensor:
    """Start the indexer on `side` once its inputs exist; it touches only the indexer pool and
    its own outputs, so it may run beside the main stream until `_join`. HiSparse's page-in stays
    on the main stream, after the join: it reads the main pool, into which the main stream's
    compressor is writing this step's closed window."""
    # x and q_in stay referenced by the caller until the join, and what the side stream
    # allocates returns to its own pool, so no block is reused across the streams before the join.
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        return _select(attn, x, q_in, cos, sin, index.new_rows, index.rates[attn.rate], pools)


def _join(rows: torch.Tensor, side) -> torch.Tensor:
    torch.cuda.current_stream(rows.device).wait_stream(side)
    return rows


def _compress(comp, x, new_rows, ridx: RateIndex, pool) -> None:
    """Store this token's projections, then close its window if it ends one (scratch otherwise).

    A pool of codes (release numerics) gets each row's entry staged in a [B, d] buffer in the model
    dtype and encoded into the pool by the same launch (`compress_windows(codes=...)`, the
    `kv_codes` encoders): the same values the general step encodes with `kv_rows.encode_kv` /
    `encode_index`."""
    comp.write_state(x, new_rows, pool)
    args = (ridx.src_rows, ridx.prev_rows, ridx.has_prev, ridx.event_cos, ridx.event_sin)
    fmt = pool.row_format
    if fmt.is_plain:
        comp.store_windows(pool, *args, ridx.event_rows)
        return
    b = x.shape[0]
    entries = torch.empty(b, comp.head_dim, dtype=x.dtype, device=x.device)
    # The indexer's keys are rotated and FP4; the main entries FP8 rows.
    layout = fp4_keys(fmt) if isinstance(comp, Indexer) else fp8_rows(fmt, 2 * ridx.event_cos.shape[-1])
    assert layout is not None
    comp.store_windows(pool, *args, _rows_of(b, x.device), out=entries,
                       codes=(pool.rows, ridx.event_rows, layout))


_ROWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _rows_of(b: int, device: torch.device) -> torch.Tensor:
    """arange(b) int64 on `device`, made once (first made by a warm-up step, before any capture)."""
    key = (device, b)
    if key not in _ROWS:
        _ROWS[key] = torch.arange(b, device=device)
    return _ROWS[key]


def _select(attn: Attention, x, q_in, cos, sin, new_rows, ridx: RateIndex, pools: KVPools) -> torch.Tensor:
    """The indexer's top-k C4 rows of each row -> [B, k] int32 pool rows (-1 padded). q_in: q_b's input."""
    indexer = attn.compressor.indexer
    ipool = pools.indexers[attn.layer]
    _compress(indexer, x, new_rows, ridx, ipool)
    b = x.shape[0]
    q = indexer.q_b_proj(q_in).view(b, indexer.num_heads, indexer.head_dim)
    q = indexer.numerics.indexer_queries(rotate(q, cos, sin))  # release: rotated and FP4-rounded
    weights = indexer.scorer.weights_proj(x).float() * indexer.num_heads**-0.5
    return indexer.top_rows(q, weights, ipool, ridx.entry_rows, ridx.num_entries)


def _page_in(attn: Attention, rows: torch.Tensor, pools: KVPools, hot_base=None) -> torch.Tensor:
    """rows: [B, k] int32 selected pool rows -> the rows the attention reads: themselves, or with
    HiSparse the hot-buffer rows they are copied to (host tier -> each row's buffer, its first k
    rows, in top-k order). Must follow this step's compressor write into the main pool."""
    hot = pools.hot
    if hot is None:
        return rows
    return gather_rows(pools.compressors[attn.layer].device_rows, rows, hot_base, hot.rows[attn.layer],
                       hot.rows_copied_on_device)
