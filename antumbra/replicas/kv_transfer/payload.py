"""What a prefill replica hands a decode replica: one request's KV rows, in the pools' own formats.

A request whose prompt of N tokens was computed (and whose first token t0 was sampled) continues
at position N. What the continuation reads, and therefore all that is sent:

  tensor                        positions / windows           shape (rows x width)
  ----------------------------  ----------------------------  -----------------------------------
  swa        (every layer)      [max(0, N-W+1), N)            [L, n_swa, kv_format.width]
  c{l}.rows  (main compressor)  windows [S*P/m, N//m)         [n_w, kv_format.width]
  i{l}.rows  (indexer keys)     windows [S*P/m, N//m)         [n_w, index_format.width]
  {c,i}{l}.state_kv / _gate     [open - (c-1)*m, N) clamped   [n_s, c*d] float32
                                 (open = (N//m)*m: the open
                                 window, and for an
                                 overlapping compressor the
                                 previous one it still reads)

W is the window, P the page size, m a compressor's rate, c its overlap (2 for CSA, 1 for HCA),
S the pages the receiver already holds (`skip_pages`): their compressed rows are not sent, and
S never reaches a page whose SWA or state rows the continuation reads, so a skipped page is read
only for its compressed rows. Rows are raw pool rows (the FP8 / FP4 codes with their scales in
`release` numerics, the model dtype in `exact`), so adoption is a copy, never a re-encoding.

`row_arithmetic` gives the bytes these rows must take from the layout alone; the payload's
`nbytes` equals it (the benchmark and the tests check both) plus, when the decode engine speculates,
one more tensor that is not a pool's:

  draft.streams               [N - m, N), m = min(N, W)       [m, n_hc, D] the model's dtype

the target's last-layer streams at the positions the MTP block's window covers, so the decode side's
drafter catches up over exactly what it would have after computing the prompt itself
(`DRAFT_STREAMS`; a payload without it adopts as well and drafts from a cold window; a context-parallel
prefill joins it from its ranks' tails). It costs
m x n_hc x D x 2 bytes in bfloat16: 4 MiB at V4-Flash's sizes (128 x 4 x 4096), about what the SWA
rows of all 43 layers take; sending the draft block's own window rows instead would be a few hundred
KiB, but needs the block on the prefill side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout

DRAFT_STREAMS = "draft.streams"


@dataclass(frozen=True)
class LayoutKey:
    """What two engines must agree on for rows of one to be rows of the other."""

    page_size: int
    window: int
    num_layers: int
    kv_format: tuple[str, int, str, int]
    index_format: tuple[str, int, str, int]
    compressors: tuple[tuple[int, int, int, int], ...]
    indexers: tuple[tuple[int, int, int, int], ...]

    @staticmethod
    def of(pools: KVPools) -> LayoutKey:
        def fmt(f) -> tuple[str, int, str, int]:
            return (f.encoding, f.width, str(f.dtype), f.head_dim)

        def specs(s: tuple[CompressorSpec, ...]) -> tuple[tuple[int, int, int, int], ...]:
            return tuple((c.layer, c.rate, c.overlap, c.head_dim) for c in s)

        lay = pools.layout
        return LayoutKey(
            lay.page_size,
            lay.window,
            lay.num_layers,
            fmt(pools.kv_format),
            fmt(pools.index_format),
            specs(lay.compressors),
            specs(lay.indexers),
        )


@dataclass(frozen=True)
class KVPayload:
    """One request's KV from position 0 (compressed rows from page `skip_pages`) up to `num_tokens`.

    All tensors are CPU (Ray object store) or on the sender's device (torch.distributed);
    `tensors` maps the names of the module docstring to them."""

    request_id: str
    layout: LayoutKey
    prompt_token_ids: tuple[int, ...]
    num_tokens: int  # N: positions [0, N) are computed
    skip_pages: int  # S: pages whose compressed rows the receiver holds (not sent)
    first_token: int  # t0, sampled by the sender at position N - 1
    first_logprobs: dict[int, float] | None
    finish_reason: str | None  # the sender's, if t0 already ended the request ("stop")
    cached_tokens: int  # prompt tokens the sender took from its own prefix cache
    text: str = ""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def num_sent_pages(self) -> int:
        return -(-self.num_tokens // self.layout.page_size) - self.skip_pages


def swa_range(layout: PoolLayout, num_tokens: int) -> tuple[int, int]:
    """Positions whose SWA kv rows the token at `num_tokens` reads."""
    return max(0, num_tokens - layout.window + 1), num_tokens


def state_range(spec: CompressorSpec, num_tokens: int) -> tuple[int, int]:
    """Positions whose state rows `spec`'s compressor still reads after `num_tokens`."""
    open_start = (num_tokens // spec.rate) * spec.rate
    return max(0, open_start - (spec.overlap - 1) * spec.rate), num_tokens


def window_range(
    layout: PoolLayout, spec: CompressorSpec, num_tokens: int, skip_pages: int
) -> tuple[int, int]:
    """Closed windows whose compressed rows are sent."""
    return skip_pages * layout.page_size // spec.rate, num_tokens // spec.rate


def max_skip_pages(layout: PoolLayout, num_tokens: int) -> int:
    """The most pages a receiver may hold back: none whose SWA / state rows the continuation reads."""
    return layout.swa_horizon(num_tokens) // layout.page_size


def row_arithmetic(pools: KVPools, num_tokens: int, skip_pages: int) -> dict[str, int]:
    """Bytes per pool a payload must carry: rows x row bytes, from the layout alone."""
    lay = pools.layout
    lo, hi = swa_range(lay, num_tokens)
    out = {
        "swa": lay.num_layers * (hi - lo) * pools.kv_format.row_bytes,
        "compressed": 0,
        "indexer": 0,
        "state": 0,
    }
    for kind, specs, fmt in (
        ("compressed", lay.compressors, pools.kv_format),
        ("indexer", lay.indexers, pools.index_format),
    ):
        for spec in specs:
            w0, w1 = window_range(lay, spec, num_tokens, skip_pages)
            out[kind] += max(0, w1 - w0) * fmt.row_bytes
            s0, s1 = state_range(spec, num_tokens)
            out["state"] += 2 * (s1 - s0) * spec.overlap * spec.head_dim * 4  # kv and gate, float32
    out["total"] = sum(out.values())
    return out
