"""Reading and writing a request's rows by position, through its block table (one code for both ends).

Both functions take the request's block table `vpages` (virtual page of each logical page) and
move exactly the rows `payload.py` lists. Row indices follow `cachestore/pools.py`: a position's
SWA / state row is `swa_page * P + pos % P`, a window's compressed row `(vpage * P + w*m % P) // m`.
"""

from __future__ import annotations

import torch

from antumbra.cachestore.pools import CompressorPool, KVPools

from .payload import state_range, swa_range, window_range


def _swa_rows(pools: KVPools, vpages: list[int], lo: int, hi: int) -> torch.Tensor:
    """[hi - lo] int64 SWA rows of positions [lo, hi); raises if one has no SWA page."""
    page = pools.layout.page_size
    table = pools.swa_page_table_host()
    rows = []
    for pos in range(lo, hi):
        swa_page = table.get(vpages[pos // page], -1)
        if swa_page < 0:
            raise RuntimeError(f"position {pos} has no SWA page attached: its rows are gone")
        rows.append(swa_page * page + pos % page)
    return torch.tensor(rows, dtype=torch.long, device=pools.device)


def _window_rows(pools: KVPools, pool: CompressorPool, vpages: list[int], w0: int, w1: int) -> torch.Tensor:
    page, rate = pools.layout.page_size, pool.spec.rate
    rows = [(vpages[w * rate // page] * page + (w * rate) % page) // rate for w in range(w0, w1)]
    return torch.tensor(rows, dtype=torch.long, device=pool.rows.device)


def _named_pools(pools: KVPools) -> list[tuple[str, CompressorPool]]:
    return [(f"c{layer}", p) for layer, p in pools.compressors.items()] + [
        (f"i{layer}", p) for layer, p in pools.indexers.items()
    ]


def read_rows(pools: KVPools, vpages: list[int], num_tokens: int, skip_pages: int) -> dict[str, torch.Tensor]:
    """Copies (CPU) of what a continuation at `num_tokens` reads: compressed rows from page `skip_pages`."""
    lay = pools.layout
    lo, hi = swa_range(lay, num_tokens)
    out = {"swa": pools.swa_kv[:, _swa_rows(pools, vpages, lo, hi)].cpu()}
    for name, pool in _named_pools(pools):
        w0, w1 = window_range(lay, pool.spec, num_tokens, skip_pages)
        out[f"{name}.rows"] = pool.rows[_window_rows(pools, pool, vpages, w0, max(w0, w1))].cpu()
        state = _swa_rows(pools, vpages, *state_range(pool.spec, num_tokens))
        out[f"{name}.state_kv"] = pool.state_kv[state].cpu()
        out[f"{name}.state_gate"] = pool.state_gate[state].cpu()
    return out


def expected_shapes(
    pools: KVPools, num_tokens: int, skip_pages: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor `read_rows` returns for these sizes (what a receiver checks)."""
    lay = pools.layout
    lo, hi = swa_range(lay, num_tokens)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "swa": ((lay.num_layers, hi - lo, pools.kv_format.width), pools.kv_format.dtype)
    }
    for name, pool in _named_pools(pools):
        w0, w1 = window_range(lay, pool.spec, num_tokens, skip_pages)
        out[f"{name}.rows"] = ((max(0, w1 - w0), pool.row_format.width), pool.row_format.dtype)
        s0, s1 = state_range(pool.spec, num_tokens)
        width = pool.state_kv.shape[1]
        out[f"{name}.state_kv"] = ((s1 - s0, width), torch.float32)
        out[f"{name}.state_gate"] = ((s1 - s0, width), torch.float32)
    return out


def write_rows(
    pools: KVPools, vpages: list[int], num_tokens: int, skip_pages: int, tensors: dict[str, torch.Tensor]
) -> None:
    """Write `read_rows`' tensors into the rows of `vpages` (SWA pages attached where read).

    The caller has checked the tensors against `expected_shapes`; every index is computed before
    the first write, so a missing SWA page raises with nothing written."""
    lay = pools.layout
    lo, hi = swa_range(lay, num_tokens)
    swa = _swa_rows(pools, vpages, lo, hi)
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for name, pool in _named_pools(pools):
        w0, w1 = window_range(lay, pool.spec, num_tokens, skip_pages)
        writes.append(
            (pool.rows, _window_rows(pools, pool, vpages, w0, max(w0, w1)), tensors[f"{name}.rows"])
        )
        state = _swa_rows(pools, vpages, *state_range(pool.spec, num_tokens))
        writes.append((pool.state_kv, state, tensors[f"{name}.state_kv"]))
        writes.append((pool.state_gate, state, tensors[f"{name}.state_gate"]))
    pools.swa_kv[:, swa] = tensors["swa"].to(pools.swa_kv.device)
    for target, rows, values in writes:
        target[rows] = values.to(target.device)
