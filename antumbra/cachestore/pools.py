"""Physical KV pools, addressed through virtual token slots.

Every token of a live sequence owns one *virtual slot* `s = vpage * page_size + offset`.
There is no full-KV pool; each physical pool is a projection ("shadow") of slots:

  pool                 row of slot s                         width
  -------------------  ------------------------------------  -------------------------
  SWA kv (per layer)   swa_page_of_vpage[s // P] * P + s % P  head_dim
  compression state    same row as SWA (lives and dies with   c*d kv + c*d gate per
  (per compressor)       the SWA page holding the token)        compressor (c=2 overlap)
  C_m kv (per layer)   s // m                                 head_dim
  C_m indexer keys     s // m                                 index_head_dim

Row widths above are in values; each pool stores its rows in a `RowFormat` (the values in the
model dtype, or packed codes with their scales in `release` numerics: replicas/model/kv_rows.py).

Invariants (checked by `check_integrity`):
  * page_size P is a multiple of every compression rate m and at least the window,
    so a compressed entry's m source tokens never straddle a page and `s // m` is a
    bijection between windows and rows;
  * every virtual page is either free or allocated, never both; same for SWA pages;
  * `swa_page_of_vpage[v] >= 0` only for allocated virtual pages, and each SWA page
    is attached to at most one virtual page;
  * free + allocated == capacity, for virtual and SWA pages alike.

Ownership (which request or cache node holds a page) is tracked by the caller; the
pools only know allocated vs free, so prefix sharing can be layered on top.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass

import torch

from antumbra.config import CSA, HCA, CacheConfig, ModelConfig

from .hisparse import HotBuffers
from .host_tier import HostTierWriter, device_view
from .row_format import RowFormat


class PoolExhausted(RuntimeError):
    """Raised when an allocation cannot be satisfied; callers check `num_free_*` first."""


@dataclass(frozen=True)
class CompressorSpec:
    layer: int
    rate: int
    overlap: int  # 2 when each entry also reads the previous window's first half (CSA), else 1
    head_dim: int


@dataclass(frozen=True)
class PoolLayout:
    page_size: int
    window: int
    num_virtual_pages: int
    num_swa_pages: int
    num_layers: int
    head_dim: int
    index_head_dim: int
    compressors: tuple[CompressorSpec, ...]  # main compressor of every CSA / HCA layer
    indexers: tuple[CompressorSpec, ...]  # indexer compressor of every CSA layer

    @property
    def num_virtual_slots(self) -> int:
        return self.num_virtual_pages * self.page_size

    @property
    def num_swa_rows(self) -> int:
        return self.num_swa_pages * self.page_size

    @property
    def steady_swa_pages_per_seq(self) -> int:
        """SWA pages a sequence holds between steps: its window, the previous window
        a compressor still reads, and the page being filled."""
        reach = max([self.window] + [s.overlap * s.rate for s in self.compressors + self.indexers])
        return (self.page_size + reach - 1) // self.page_size + 1

    def swa_horizon(self, next_position: int) -> int:
        """First position whose SWA / state row a sequence still needs before it
        computes the token at `next_position`: the window's oldest key, and the
        oldest token of each compressor's still-open window (for overlapping
        compressors, of the previous window too)."""
        horizon = next_position - self.window + 1
        for rate, overlap in self._compressor_shapes:
            open_start = (next_position // rate) * rate
            horizon = min(horizon, open_start - (overlap - 1) * rate)
        return max(horizon, 0)

    @functools.cached_property
    def _compressor_shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct (rate, overlap) of the compressors and indexers: the horizon depends on
        nothing else, and layers share a few (the horizon is asked per request per step)."""
        return tuple(sorted({(s.rate, s.overlap) for s in self.compressors + self.indexers}))

    @property
    def swa_tail_tokens(self) -> int:
        """Tokens before a page boundary whose SWA / state rows a continuation reads."""
        boundary = self.page_size * max(2, -(-2 * self.window // self.page_size) + 2)
        return boundary - self.swa_horizon(boundary)

    def replay_tokens(self, num_layers: int) -> int:
        """Tokens to recompute before a boundary so the SWA tail is exact at every layer.

        A layer-l row of token t is exact once the replay started at least l*(W-1)
        tokens before t (each layer widens the receptive field by the window);
        the tail needs rows of all layers, so (L-1)*(W-1) plus the tail, page-aligned.
        """
        tokens = (num_layers - 1) * (self.window - 1) + self.swa_tail_tokens
        return -(-tokens // self.page_size) * self.page_size

    @staticmethod
    def build(model: ModelConfig, cache: CacheConfig, num_swa_pages: int) -> PoolLayout:
        compressors, indexers = [], []
        for layer, kind in enumerate(model.layer_types):
            if kind == CSA:
                rate = model.compress_rates[CSA]
                compressors.append(CompressorSpec(layer, rate, 2, model.head_dim))
                indexers.append(CompressorSpec(layer, rate, 2, model.index_head_dim))
            elif kind == HCA:
                compressors.append(CompressorSpec(layer, model.compress_rates[HCA], 1, model.head_dim))
        return PoolLayout(
            page_size=model.page_size,
            window=model.sliding_window,
            num_virtual_pages=-(-cache.num_virtual_tokens // model.page_size),
            num_swa_pages=num_swa_pages,
            num_layers=model.num_layers,
            head_dim=model.head_dim,
            index_head_dim=model.index_head_dim,
            compressors=tuple(compressors),
            indexers=tuple(indexers),
        )


class CompressorPool:
    """One compressor's pools: its compressed rows (`s // rate`) and its state rows (SWA rows)."""

    def __init__(
        self,
        spec: CompressorSpec,
        layout: PoolLayout,
        row_format: RowFormat,
        device: torch.device,
        rows_device: torch.device | None = None,
        writer: HostTierWriter | None = None,
    ):
        if row_format.head_dim != spec.head_dim:
            raise ValueError(
                f"layer {spec.layer}: row format of width {row_format.head_dim}, pool of {spec.head_dim}"
            )
        self.spec = spec
        self.row_format = row_format
        width = spec.overlap * spec.head_dim
        self.on_host_tier = rows_device is not None
        rows_device = rows_device or device
        # One row past the addressable ones is scratch: a padded row of a fixed-shape
        # (CUDA-graph) decode batch writes there instead of into a live row.
        num_rows = layout.num_virtual_slots // spec.rate + 1
        rows = torch.zeros(num_rows, row_format.width, dtype=row_format.dtype, device=rows_device)
        if rows_device.type == "cpu" and device.type == "cuda":
            rows = rows.pin_memory()  # host tier: pinned so copies to the device run asynchronously
        self.rows = rows
        # What device kernels address: `rows` itself, or for a host tier on a GPU engine its pinned
        # memory through the device mapping (the fixed-shape decode step pages rows in from it and
        # the fused compressor writes new rows through it; `host_tier.py`).
        self.device_rows = device_view(rows, device) if self.on_host_tier else rows
        # A host tier's rows written by general steps go through here (off the compute stream).
        self.writer = (writer or HostTierWriter(device)) if self.on_host_tier else None
        # Pending projections of the tokens whose window is not closed yet, kept in
        # float32 because the gated softmax over the window runs in float32.
        self.state_kv = torch.zeros(layout.num_swa_rows + 1, width, dtype=torch.float32, device=device)
        self.state_gate = torch.zeros(layout.num_swa_rows + 1, width, dtype=torch.float32, device=device)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """rows: [E] int64 on the compute device; values: [E, width] rows of `row_format`, there too.
        A host tier's are queued on its writer (`HostTierWriter.scatter`): device readers call
        `order_reads` first."""
        if self.writer is None:
            self.rows[rows] = values
        else:
            self.writer.scatter(self.device_rows, rows, values.contiguous())

    def order_reads(self) -> None:
        """The compute stream waits for this pool's queued host-tier writes (none without a host tier)."""
        if self.writer is not None:
            self.writer.order_reads()

    @property
    def scratch_row(self) -> int:
        """Compressed row no slot maps to (padded rows of a fixed-shape batch write it)."""
        return self.rows.shape[0] - 1


def _set(table: torch.Tensor, index: int, value: int) -> None:
    """table[index] = value without a host-to-device copy: `table[i] = v` on a CUDA tensor copies v
    from pageable memory, which waits for the stream (with overlap scheduling, for the decode graph
    in flight); a fill launches a kernel that carries v as an argument and returns at once."""
    table[index].fill_(value)


class KVPools:
    def __init__(
        self,
        layout: PoolLayout,
        dtype: torch.dtype,
        device: torch.device | str,
        hot: HotBuffers | None = None,
        kv_format: RowFormat | None = None,
        index_format: RowFormat | None = None,
    ) -> None:
        """`dtype`: the model dtype rows decode to. `kv_format` (SWA and main compressed rows) and
        `index_format` (indexer keys) say how rows are stored; None stores the values in `dtype`.
        `hot` set: the CSA layers' compressed rows live on the host tier, read through `hot`."""
        device = torch.device(device)
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.hot = hot
        self.kv_format = kv_format or RowFormat.plain(layout.head_dim, dtype)
        self.index_format = index_format or RowFormat.plain(layout.index_head_dim, dtype)
        for fmt in (self.kv_format, self.index_format):
            if fmt.value_dtype != dtype:
                raise ValueError(
                    f"row format {fmt.encoding!r} decodes to {fmt.value_dtype}, the pools' dtype is {dtype}"
                )
        if hot is not None and hot.row_format != self.kv_format:
            raise ValueError("HiSparse hot buffers must store rows in the KV pools' format")
        host = torch.device("cpu")
        # One side stream writes every CSA layer's new rows into its host tier.
        self.host_writer = HostTierWriter(device) if hot is not None else None
        # Row `num_swa_rows` of the SWA and state pools is scratch (see `scratch_swa_row`).
        self.swa_kv = torch.zeros(
            layout.num_layers,
            layout.num_swa_rows + 1,
            self.kv_format.width,
            dtype=self.kv_format.dtype,
            device=device,
        )
        self.compressors = {
            s.layer: CompressorPool(
                s, layout, self.kv_format, device, host if hot is not None and s.overlap == 2 else None,
                self.host_writer,
            )
            for s in layout.compressors
        }
        self.indexers = {
            s.layer: CompressorPool(s, layout, self.index_format, device) for s in layout.indexers
        }
        self.swa_page_of_vpage = torch.full((layout.num_virtual_pages,), -1, dtype=torch.long, device=device)
        self._swa_page_of_vpage_host: dict[int, int] = {}
        self._free_vpages: deque[int] = deque(range(layout.num_virtual_pages))
        self._used_vpages: set[int] = set()
        self._free_swa_pages: deque[int] = deque(range(layout.num_swa_pages))
        # When a list, `copy_compressed` also appends (from, to) here: rank 0 of a parallel replica
        # replays these copies on its other ranks (replicas/parallel/step.py).
        self.compressed_copies: list[tuple[int, int]] | None = None

    @property
    def scratch_swa_row(self) -> int:
        """SWA / state row no slot maps to: padded rows of a fixed-shape decode batch
        (CUDA graphs) write their keys and compression state here."""
        return self.layout.num_swa_rows

    def swa_page_table_host(self) -> dict[int, int]:
        """virtual page -> attached SWA page, the host copy (read-only view for index building)."""
        return self._swa_page_of_vpage_host

    # ----- virtual pages -----
    @property
    def num_free_virtual_pages(self) -> int:
        return len(self._free_vpages)

    @property
    def num_free_swa_pages(self) -> int:
        return len(self._free_swa_pages)

    def alloc_virtual_pages(self, count: int) -> list[int]:
        if count > len(self._free_vpages):
            raise PoolExhausted(f"need {count} virtual pages, {len(self._free_vpages)} free")
        pages = [self._free_vpages.popleft() for _ in range(count)]
        self._used_vpages.update(pages)
        return pages

    def free_virtual_pages(self, pages: list[int]) -> None:
        for vpage in pages:
            if vpage not in self._used_vpages:
                raise ValueError(f"virtual page {vpage} freed but not allocated")
            if vpage in self._swa_page_of_vpage_host:
                self.detach_swa(vpage)
            self._used_vpages.remove(vpage)
            self._free_vpages.append(vpage)

    # ----- SWA pages (and the compression state that lives in them) -----
    def has_swa(self, vpage: int) -> bool:
        return vpage in self._swa_page_of_vpage_host

    def attach_swa(self, vpage: int) -> int:
        if vpage not in self._used_vpages:
            raise ValueError(f"SWA page attached to unallocated virtual page {vpage}")
        if vpage in self._swa_page_of_vpage_host:
            return self._swa_page_of_vpage_host[vpage]
        if not self._free_swa_pages:
            raise PoolExhausted("no free SWA page")
        page = self._free_swa_pages.popleft()
        self._swa_page_of_vpage_host[vpage] = page
        _set(self.swa_page_of_vpage, vpage, page)
        return page

    def detach_swa(self, vpage: int) -> None:
        page = self._swa_page_of_vpage_host.pop(vpage)
        _set(self.swa_page_of_vpage, vpage, -1)
        self._free_swa_pages.append(page)

    def move_swa(self, from_vpage: int, to_vpage: int) -> None:
        """Re-point a physical SWA page (and the state rows in it) to another virtual page
        holding the same tokens, so a duplicate's live rows can revive a cached copy."""
        if to_vpage in self._swa_page_of_vpage_host:
            raise ValueError(f"virtual page {to_vpage} already has an SWA page")
        page = self._swa_page_of_vpage_host.pop(from_vpage)
        _set(self.swa_page_of_vpage, from_vpage, -1)
        self._swa_page_of_vpage_host[to_vpage] = page
        _set(self.swa_page_of_vpage, to_vpage, page)

    def order_host_writes(self) -> None:
        """The compute stream waits for every queued host-tier write (the end of a general step)."""
        if self.host_writer is not None:
            self.host_writer.order_reads()

    def copy_compressed(self, from_vpage: int, to_vpage: int) -> None:
        """Copy a page's compressed rows (every C_m pool and indexer) to another page."""
        if self.compressed_copies is not None:
            self.compressed_copies.append((from_vpage, to_vpage))
        if self.host_writer is not None:
            self.host_writer.settle()  # host tiers are copied by the host: their writes land first
        page = self.layout.page_size
        for pool in list(self.compressors.values()) + list(self.indexers.values()):
            per_page = page // pool.spec.rate
            src, dst = from_vpage * per_page, to_vpage * per_page
            pool.rows[dst : dst + per_page] = pool.rows[src : src + per_page]

    def mirror_swa_pages(self, vpages: torch.Tensor, pages: torch.Tensor) -> None:
        """Take another rank's attachments (replicas/parallel/): vpages, pages [n] int64 on the host,
        page -1 = none. Sets the device table and its host copy (the step index checks the latter);
        the free lists stay with the rank that allocates."""
        self.swa_page_of_vpage[vpages.to(self.device)] = pages.to(self.device)
        for vpage, page in zip(vpages.tolist(), pages.tolist(), strict=True):
            if page >= 0:
                self._swa_page_of_vpage_host[vpage] = page
            else:
                self._swa_page_of_vpage_host.pop(vpage, None)

    def num_swa_pages_of(self, vpages: list[int]) -> int:
        return sum(1 for v in vpages if v in self._swa_page_of_vpage_host)

    # ----- integrity -----
    def check_integrity(self) -> None:
        lay = self.layout
        free = list(self._free_vpages)
        assert len(free) == len(set(free)), "virtual page on the free list twice"
        assert not set(free) & self._used_vpages, "virtual page both free and allocated"
        assert len(free) + len(self._used_vpages) == lay.num_virtual_pages, "virtual pages leaked"
        swa_free = list(self._free_swa_pages)
        attached = list(self._swa_page_of_vpage_host.values())
        assert len(swa_free) == len(set(swa_free)), "SWA page on the free list twice"
        assert len(attached) == len(set(attached)), "SWA page attached to two virtual pages"
        assert not set(swa_free) & set(attached), "SWA page both free and attached"
        assert len(swa_free) + len(attached) == lay.num_swa_pages, "SWA pages leaked"
        assert set(self._swa_page_of_vpage_host) <= self._used_vpages, "SWA page on a free virtual page"
        table = self.swa_page_of_vpage.tolist()
        for vpage, page in enumerate(table):
            assert page == self._swa_page_of_vpage_host.get(vpage, -1), f"SWA table out of sync at {vpage}"

    def device_bytes(self) -> int:
        """Bytes these pools hold on the compute device (host-tier rows excluded)."""
        tensors = [self.swa_kv]
        for pool in list(self.compressors.values()) + list(self.indexers.values()):
            tensors += [pool.state_kv, pool.state_gate]
            if not pool.on_host_tier:
                tensors.append(pool.rows)
        total = sum(t.numel() * t.element_size() for t in tensors)
        return total + (self.hot.device_bytes() if self.hot is not None else 0)

    def usage(self) -> dict[str, float]:
        lay = self.layout
        return {
            "virtual": 1 - self.num_free_virtual_pages / lay.num_virtual_pages,
            "swa": 1 - self.num_free_swa_pages / max(lay.num_swa_pages, 1),
        }
