"""The interface between the scheduler and the cache store: who holds which page.

A request's block table (`request.kv.vpages`) maps logical page i to a virtual page:

    | shared: tree nodes (locked)  | own: allocated for this request ...         |
    0                      num_shared_pages                          len(vpages)

Shared pages come from a prefix-cache match (cachestore/contract.py states what the
cache guarantees) and are read-only (their tokens are computed). Own pages are
allocated as chunks need them. SWA pages are attached to own pages right before a
chunk writes them and detached once they slide behind the sequence's `swa_horizon`;
for shared pages the request holds `swa_lock`s on the tail it reads, released the
same way.

SWA replay: when the deepest cached prefix (K pages) has its compressed rows but a
dead SWA tail, and recomputing the last `replay_tokens` is cheaper than computing
from the deepest live tail, the request shares pages [0, K - R) and recomputes
pages [K - R, K) into own pages whose compressed rows are copied from the tree.
While it replays, windows that close at or before `replay_until` keep their copied
(exact) compressed rows instead of being rewritten, and SWA rows before
`exact_swa_from` are known to be inexact and never enter the tree.

Prompt checkpoint. A later request with the same prompt (n tokens) matches at most up to
the prompt's reuse boundary b = floor((n-t)/P)*P (t = 1, or a speculating request's drafter
window: `_reuse_pages`), and only if the pages covering
[swa_horizon(b), b) (the *checkpoint pages*, what `swa_tail` asks of a match ending at b)
still have their SWA rows. A request slides past them while it decodes, so they would lose
their SWA long before `release` inserts its pages. Invariant kept by `release_slid_out`:

  * When the request's horizon first passes the first checkpoint page (the prompt up to b
    is computed by then), the prompt's pages [0, b/P) join the tree at once: the pages
    before the checkpoint lose their SWA rows first (as they would anyway), the checkpoint
    pages keep theirs. The block table does not change; `shared_path` now reaches b/P, with
    a full lock on every page and an SWA lock only on the pages the request still reads.
  * A checkpoint belongs to the tree, never to the request: once behind the horizon it is
    SWA-unlocked, so `evict_swa` may take it under SWA pressure (LRU) and `can_free` counts
    it as evictable. A running request is thus never blocked by a checkpoint, and holds no
    more SWA pages than without one.
  * When the tree already has pages of the prompt past `shared_path` (another request
    computed the same prompt, or this one replays it), nothing joins the tree: the request
    cannot share pages it computed itself. A tombstoned node that duplicates a checkpoint
    page behind the horizon is revived with the request's SWA page instead (the insert rule).
  * SWA rows known to be inexact (before `exact_swa_from`) never become a checkpoint.
  * Pages join the tree only after the steps that computed them succeeded; a later failing
    step writes positions past b only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from antumbra.cachestore.contract import CacheNode, PrefixCache, PrefixMatch
from antumbra.cachestore.pools import KVPools, PoolExhausted

from .request import Request


@dataclass
class CacheCounters:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_replays: int = 0
    num_replayed_tokens: int = 0
    num_preemptions: int = 0
    num_computed_prompt_tokens: int = 0


class PageNeed(NamedTuple):
    """What a request lacks to compute up to some position."""

    num_vpages: int  # virtual pages to append to its block table
    num_swa_pages: int  # SWA pages to attach (to pages of the chunk that have none)


class KVManager:
    """Every method either does all it says or, when it reports failure, changes nothing
    (pools, cache, request): the scheduler retries with a smaller chunk or preempts, and a
    half-grown request would hold pages nobody accounts for."""

    def __init__(
        self, pools: KVPools, tree: PrefixCache | None, num_layers: int, enable_replay: bool
    ) -> None:
        self.pools = pools
        self.tree = tree
        self.page_size = pools.layout.page_size
        self.window = pools.layout.window
        self.num_layers = num_layers
        self.enable_replay = enable_replay and tree is not None
        self.replay_tokens = pools.layout.replay_tokens(num_layers)
        self.counters = CacheCounters()

    # ------------------------------------------------------------------ admission
    def admit(self, request: Request) -> None:
        """Match the request's known tokens in the cache and set up its block table.

        Leaves at least one token to compute, so the request always gets logits (a speculating
        request: `SpecState.catch_up_tokens`, the drafter's window). A replay
        whose pages cannot be had falls back to sharing the live part of the match, which
        takes no page, so admission itself never runs out of pages.
        """
        assert not request.kv.vpages and not request.kv.shared_path
        if self.pools.hot is not None:
            request.kv.hot_buffer = self.pools.hot.allocate()
        tokens = request.all_token_ids()
        first_admission = request.num_preemptions == 0
        request.num_computed_tokens = 0
        if first_admission:
            request.num_cached_tokens = 0
        request.kv.replay_until = 0
        request.kv.exact_swa_from = 0
        if self.tree is not None and not request.computes_every_token:
            match = self.tree.match(request.namespace, tokens, self._reuse_pages(request, len(tokens)))
            reused = self._admit_with_replay(request, match) if self._should_replay(match) else None
            if reused is None:
                reused = self._admit_direct(request, match)
            if first_admission:
                request.num_cached_tokens = reused
        if first_admission:
            self.counters.num_prompt_tokens += request.num_prompt_tokens
            self.counters.num_cached_tokens += request.num_cached_tokens

    def _reuse_pages(self, request: Request, num_tokens: int) -> int:
        """The most pages of `num_tokens` known tokens a match may share: at least one token is left to
        compute, and for a request keeping streams its drafter's window (`Request.min_tokens_to_compute`)."""
        return max(0, num_tokens - request.min_tokens_to_compute) // self.page_size

    def _should_replay(self, match: PrefixMatch) -> bool:
        if not self.enable_replay or match.num_full_pages <= match.num_swa_pages:
            return False
        start_page = match.num_full_pages - self.replay_tokens // self.page_size
        return start_page > match.num_swa_pages and start_page >= 0

    def _admit_direct(self, request: Request, match: PrefixMatch) -> int:
        assert self.tree is not None
        shared = list(match.path[: match.num_swa_pages])
        tail = self.tree.swa_tail(shared, len(shared))
        self.tree.lock(shared, tail)
        request.kv.shared_path = shared
        request.kv.swa_locked = {n.depth - 1: n for n in tail}
        request.kv.vpages = [n.vpage for n in shared]
        request.num_computed_tokens = len(shared) * self.page_size
        return request.num_computed_tokens

    def _admit_with_replay(self, request: Request, match: PrefixMatch) -> int | None:
        """Share the match up to the replay's start and copy the compressed rows of the rest.

        Returns None, holding nothing, when the replayed pages cannot be had even by
        evicting (the caller then admits directly, which needs no page).
        """
        assert self.tree is not None
        matched = match.path
        start_page = len(matched) - self.replay_tokens // self.page_size
        shared, replayed = list(matched[:start_page]), matched[start_page:]
        # The matched nodes are not locked yet: lock all of them while making room, or the
        # eviction could free the very pages whose compressed rows the replay copies.
        self.tree.lock(matched, [])
        own = self._take_pages(PageNeed(len(replayed), 0))
        if own is not None:
            for node, vpage in zip(replayed, own, strict=True):
                self.pools.copy_compressed(node.vpage, vpage)
        self.tree.unlock(matched)
        if own is None:
            return None
        self.tree.lock(shared, [])
        request.kv.shared_path = shared
        request.kv.swa_locked = {}
        request.kv.vpages = [n.vpage for n in shared] + own
        start = start_page * self.page_size
        request.num_computed_tokens = start
        request.kv.replay_until = len(matched) * self.page_size
        request.kv.exact_swa_from = start + (self.num_layers - 1) * (self.window - 1)
        self.counters.num_replays += 1
        self.counters.num_replayed_tokens += request.kv.replay_until - start
        return start

    # ------------------------------------------------------------------ growth
    def pages_needed(self, request: Request, stop: int) -> PageNeed:
        """Pages missing for the request to compute positions up to `stop`."""
        first = request.num_computed_tokens // self.page_size
        last = (stop - 1) // self.page_size
        new_vpages = max(0, last + 1 - len(request.kv.vpages))
        new_swa = sum(
            1
            for logical in range(first, last + 1)
            if logical >= len(request.kv.vpages) or not self.pools.has_swa(request.kv.vpages[logical])
        )
        return PageNeed(new_vpages, new_swa)

    def can_free(self, vpages: int, swa_pages: int) -> bool:
        """Whether free plus evictable pages cover the need.

        Exact, not a hint (contract invariant 6): the cache frees exactly what it reports
        evictable, and a full eviction leaves free + evictable SWA pages unchanged, so when
        this holds `_make_room` then the allocations succeed, and when it fails nothing needs
        to be evicted to find out."""
        free_v, free_s = self.pools.num_free_virtual_pages, self.pools.num_free_swa_pages
        if free_v >= vpages and free_s >= swa_pages:
            return True
        if self.tree is None:
            return False
        return (
            free_v + self.tree.evictable_full_pages() >= vpages
            and free_s + self.tree.evictable_swa_pages() >= swa_pages
        )

    def grow(self, request: Request, stop: int) -> bool:
        """Give the request pages (and SWA pages) for positions up to `stop`, evicting
        cached pages if needed. Returns False, changing nothing, if that cannot be done."""
        vpages = request.kv.vpages
        last = (stop - 1) // self.page_size
        if last < len(vpages) and self.pools.has_swa(vpages[last]):
            # Every page the chunk writes is in the table with its SWA rows (a decode inside its
            # page: most steps), so nothing is taken or attached: `pages_needed` would be zero.
            first = request.num_computed_tokens // self.page_size
            if first == last or all(self.pools.has_swa(v) for v in vpages[first:last]):
                return True
        need = self.pages_needed(request, stop)
        new_vpages = self._take_pages(need)
        if new_vpages is None:
            return False
        block_table = request.kv.vpages + new_vpages
        first, last = request.num_computed_tokens // self.page_size, (stop - 1) // self.page_size
        attached: list[int] = []
        try:
            for vpage in block_table[first : last + 1]:
                if not self.pools.has_swa(vpage):
                    self.pools.attach_swa(vpage)
                    attached.append(vpage)
        except PoolExhausted:  # only if the cache broke its contract: undo, and say so
            for vpage in attached:
                self.pools.detach_swa(vpage)
            self.pools.free_virtual_pages(new_vpages)
            raise
        request.kv.vpages.extend(new_vpages)
        return True

    def _take_pages(self, need: PageNeed) -> list[int] | None:
        """Make room for `need` and allocate its virtual pages (SWA pages stay free for the caller
        to attach); None, with nothing evicted or allocated, when free plus evictable fall short."""
        if not self.can_free(need.num_vpages, need.num_swa_pages):
            return None
        self._make_room(need)
        return self.pools.alloc_virtual_pages(need.num_vpages)

    def _make_room(self, need: PageNeed) -> None:
        """Evict just enough cached pages; full eviction first, as it also frees SWA pages."""
        if self.tree is None:
            return
        missing_vpages = need.num_vpages - self.pools.num_free_virtual_pages
        if missing_vpages > 0:
            self.tree.evict_full(missing_vpages)
        missing_swa_pages = need.num_swa_pages - self.pools.num_free_swa_pages
        if missing_swa_pages > 0:
            self.tree.evict_swa(missing_swa_pages)

    def release_slid_out(self, request: Request) -> None:
        """Drop SWA rows the request will not read again (its window and open compressor windows),
        first handing the prompt's checkpoint to the cache when the horizon reaches it."""
        horizon_page = self.pools.layout.swa_horizon(request.num_computed_tokens) // self.page_size
        self._checkpoint_prompt(request, horizon_page)
        for logical in range(request.kv.swa_released_pages, horizon_page):
            if logical < len(request.kv.shared_path):
                node = request.kv.swa_locked.pop(logical, None)
                if node is not None and self.tree is not None:
                    self.tree.release_swa(node)
            elif self.pools.has_swa(request.kv.vpages[logical]):
                self.pools.detach_swa(request.kv.vpages[logical])
        request.kv.swa_released_pages = max(request.kv.swa_released_pages, horizon_page)

    def checkpoint_pages(self, request: Request) -> range:
        """Logical pages whose SWA rows a match of the request's prompt up to its reuse boundary reads."""
        boundary = self._reuse_pages(request, request.num_prompt_tokens) * self.page_size
        return range(self.pools.layout.swa_horizon(boundary) // self.page_size, boundary // self.page_size)

    def _checkpoint_prompt(self, request: Request, horizon_page: int) -> None:
        """Keep the SWA rows of the prompt's checkpoint in the cache (module docstring): once,
        when the horizon first moves past the checkpoint's first page."""
        kv = request.kv
        if kv.checkpoint is None:  # a function of the prompt's length: once per request
            kv.checkpoint = self.checkpoint_pages(request)
        checkpoint = kv.checkpoint
        if not kv.swa_released_pages <= checkpoint.start < horizon_page:  # every step but one: done here
            return
        if self.tree is None or not checkpoint or len(kv.shared_path) >= checkpoint.stop:
            return
        if checkpoint.start * self.page_size < kv.exact_swa_from:
            return
        for logical in range(max(kv.swa_released_pages, len(kv.shared_path)), checkpoint.start):
            if self.pools.has_swa(kv.vpages[logical]):
                self.pools.detach_swa(kv.vpages[logical])
        tokens = request.all_token_ids()[: checkpoint.stop * self.page_size]
        cached = self.tree.match(request.namespace, tokens, checkpoint.stop, touch=False).path
        if len(cached) > len(kv.shared_path):
            # Pages it computed itself stay its own; only tombstones it duplicates take its SWA.
            num_pages = min(len(cached), horizon_page)
            if num_pages > len(kv.shared_path):
                self.tree.insert(
                    request.namespace, tokens[: num_pages * self.page_size], kv.vpages[:num_pages],
                    len(kv.shared_path),
                )
            return
        self._share_prompt(request, tokens, horizon_page)

    def _share_prompt(self, request: Request, tokens: list[int], horizon_page: int) -> None:
        """Insert the prompt's pages `tokens` covers (none cached past `shared_path`) and share them."""
        assert self.tree is not None
        kv, num_pages = request.kv, len(tokens) // self.page_size
        duplicates = self.tree.insert(request.namespace, tokens, kv.vpages[:num_pages], len(kv.shared_path))
        assert not duplicates, "the prompt's pages were cached meanwhile"
        path = self.tree.match(request.namespace, tokens, num_pages, touch=False).path
        assert len(path) == num_pages and [n.vpage for n in path] == kv.vpages[:num_pages]
        still_read = [node for node in path[len(kv.shared_path) :] if node.depth - 1 >= horizon_page]
        self.tree.lock(path, still_read)
        self.tree.unlock(kv.shared_path)
        kv.shared_path = list(path)
        kv.swa_locked.update({node.depth - 1: node for node in still_read})

    # ------------------------------------------------------------------ release
    def release(self, request: Request, cache: bool = True) -> None:
        """Give back everything the request holds; its computed full pages join the cache."""
        own = request.kv.vpages[len(request.kv.shared_path) :]
        for node in request.kv.swa_locked.values():
            assert self.tree is not None
            self.tree.release_swa(node)
        request.kv.swa_locked = {}
        num_full = request.num_computed_tokens // self.page_size
        leftover = list(own)
        if self.tree is not None and cache:
            self._drop_inexact_swa(request, num_full)
            tokens = request.all_token_ids()[: num_full * self.page_size]
            adopted_until = max(num_full, len(request.kv.shared_path))
            handle = request.kv
            duplicates = self.tree.insert(request.namespace, tokens, handle.vpages, len(handle.shared_path))
            leftover = duplicates + request.kv.vpages[adopted_until:]
        if self.tree is not None:
            self.tree.unlock(request.kv.shared_path)
        self.pools.free_virtual_pages(leftover)
        request.kv.vpages = []
        request.kv.shared_path = []
        request.kv.swa_released_pages = 0
        if request.kv.hot_buffer >= 0 and self.pools.hot is not None:
            self.pools.hot.release(request.kv.hot_buffer)
            request.kv.hot_buffer = -1

    def _drop_inexact_swa(self, request: Request, num_full: int) -> None:
        for logical in range(len(request.kv.shared_path), num_full):
            page_start = logical * self.page_size
            vpage = request.kv.vpages[logical]
            if page_start < request.kv.exact_swa_from and self.pools.has_swa(vpage):
                self.pools.detach_swa(vpage)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self, running: list[Request]) -> None:
        self.pools.check_integrity()
        owned = [v for r in running for v in r.kv.vpages[len(r.kv.shared_path) :]]
        tree_owned = self.tree.owned_vpages() if self.tree is not None else []
        all_owned = owned + tree_owned
        assert len(all_owned) == len(set(all_owned)), "a virtual page has two owners"
        assert len(all_owned) == self.pools.layout.num_virtual_pages - self.pools.num_free_virtual_pages, (
            "allocated virtual pages without an owner"
        )
        for r in running:
            for node in r.kv.shared_path:
                assert node.full_lock > 0, f"{r.request_id} shares an unlocked node"
        if self.tree is not None:
            self.tree.check_integrity()
            locks: dict[int, int] = {}
            swa_locks: dict[int, int] = {}
            for r in running:
                for node in r.kv.shared_path:
                    locks[id(node)] = locks.get(id(node), 0) + 1
                for node in r.kv.swa_locked.values():
                    swa_locks[id(node)] = swa_locks.get(id(node), 0) + 1
            for node in self.tree.nodes_by_depth():
                assert node.full_lock == locks.get(id(node), 0), (
                    "full_lock differs from the requests holding it"
                )
                assert node.swa_lock == swa_locks.get(id(node), 0), (
                    "swa_lock differs from the requests holding it"
                )


__all__ = ["KVManager", "CacheCounters", "CacheNode", "PageNeed"]
