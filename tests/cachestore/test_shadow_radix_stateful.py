"""Random admit / compute / finish / abort / touch / evict sequences against ShadowRadix and the
pools, with every invariant checked after every step (a hypothesis state machine, no model).

Two machines run the same rules: a small one (page 16, prompts of a few pages, pools that run
out often) and a large one (page 4, prompts of hundreds of pages, trees of thousands). Each
eviction must free exactly what the sweeping implementation would have (radix_reference.py),
and a grow that reports failure must leave pools, tree and request unchanged.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.replicas.kv_manager import KVManager
from antumbra.replicas.request import Request
from antumbra.replicas.sampling_params import SamplingParams
from tests.cachestore.radix_reference import CheckedEvictions


def snapshot(kv: KVManager, tree: ShadowRadix, request: Request) -> tuple:
    """What a failed grow must leave as it was."""
    nodes = [(n.vpage, n.full_lock, n.swa_lock, n.swa_tombstone) for n in tree.nodes_by_depth()]
    pools = kv.pools
    return (
        list(request.kv.vpages),
        request.num_computed_tokens,
        pools.num_free_virtual_pages,
        pools.num_free_swa_pages,
        dict(pools.swa_page_table_host()),
        nodes,
        tree.stats(),
    )


def cache_machine(
    layout: PoolLayout, pieces: list[list[int]], max_chunk_tokens: int, max_evict_pages: int, warm_up: bool
) -> type[RuleBasedStateMachine]:
    """A state machine over `layout`; prompts are built from `pieces` so that prefixes collide.
    `warm_up`: each run starts by caching a few whole prompts, so the tree starts large."""
    page = layout.page_size
    prompt_pieces = st.lists(st.integers(0, len(pieces) - 1), min_size=1, max_size=4)

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.pools = KVPools(layout, torch.float32, "cpu")
            self.checked = CheckedEvictions()
            self.tree = ShadowRadix(self.pools, self.checked.record)
            self.kv = KVManager(self.pools, self.tree, layout.num_layers, enable_replay=True)
            self.running: list[Request] = []
            self.ids = 0

        if warm_up:
            whole_prompts = st.lists(prompt_pieces, min_size=1, max_size=4)

            @initialize(prompts=whole_prompts, namespace=st.sampled_from(["a", "b"]))
            def cache_whole_prompts(self, prompts, namespace):
                for chosen in prompts:
                    prompt = [t for i in chosen for t in pieces[i]] + [7]
                    self.ids += 1
                    params = SamplingParams()
                    request = Request(f"w{self.ids}", prompt, params, None, None, namespace=namespace)
                    self.kv.admit(request)
                    if self.grow(request, request.num_tokens):
                        request.num_computed_tokens = request.num_tokens
                        self.kv.release_slid_out(request)
                    self.kv.release(request)
                    self.kv.check_integrity(self.running)

        def grow(self, request: Request, stop: int) -> bool:
            before = snapshot(self.kv, self.tree, request)
            grown = self.kv.grow(request, stop)
            if not grown:
                assert snapshot(self.kv, self.tree, request) == before, "a failed grow changed something"
            return grown

        @rule(
            chosen=prompt_pieces,
            tail=st.integers(1, page),
            namespace=st.sampled_from(["a", "b"]),
        )
        def admit(self, chosen, tail, namespace):
            prompt = [t for i in chosen for t in pieces[i]] + [7] * tail
            self.ids += 1
            request = Request(f"r{self.ids}", prompt, SamplingParams(), None, None, namespace=namespace)
            self.kv.admit(request)
            assert request.num_computed_tokens % page == 0
            assert request.num_computed_tokens < request.num_tokens
            if self.grow(request, request.num_computed_tokens + 1):
                self.running.append(request)
            else:
                self.kv.release(request, cache=False)

        @precondition(lambda self: self.running)
        @rule(which=st.integers(0, 50), count=st.integers(1, max_chunk_tokens))
        def compute(self, which, count):
            request = self.running[which % len(self.running)]
            count = min(count, request.num_tokens - request.num_computed_tokens)
            if count == 0:
                request.output_token_ids.append(9)
                return
            if request.kv.replay_until > request.num_computed_tokens:
                count = min(count, request.kv.replay_until - request.num_computed_tokens)
            if self.grow(request, request.num_computed_tokens + count):
                request.num_computed_tokens += count
                self.kv.release_slid_out(request)

        @precondition(lambda self: self.running)
        @rule(which=st.integers(0, 50), cache=st.booleans())
        def finish_or_abort(self, which, cache):
            request = self.running.pop(which % len(self.running))
            self.kv.release(request, cache=cache)

        @rule(
            chosen=st.lists(st.integers(0, len(pieces) - 1), min_size=1, max_size=3),
            namespace=st.sampled_from(["a", "b"]),
        )
        def touch(self, chosen, namespace):
            tokens = [t for i in chosen for t in pieces[i]]
            self.tree.match(namespace, tokens, len(tokens) // page)

        @rule(count=st.integers(1, max_evict_pages))
        def evict_full(self, count):
            self.checked.evict_full(self.tree, count)

        @rule(count=st.integers(1, max_evict_pages))
        def evict_swa(self, count):
            self.checked.evict_swa(self.tree, count)

        @invariant()
        def integrity(self):
            self.kv.check_integrity(self.running)
            for request in self.running:
                own = request.kv.vpages[len(request.kv.shared_path) :]
                held = self.pools.num_swa_pages_of(own) + len(request.kv.swa_locked)
                assert held <= layout.steady_swa_pages_per_seq

        def teardown(self):
            for request in self.running:
                self.kv.release(request)
            self.tree.clear()
            self.kv.check_integrity([])
            assert self.pools.num_free_virtual_pages == layout.num_virtual_pages
            assert self.pools.num_free_swa_pages == layout.num_swa_pages

    return CacheMachine


SMALL_PAGE = 16
SMALL = PoolLayout(
    page_size=SMALL_PAGE,
    window=8,
    num_virtual_pages=24,
    num_swa_pages=9,
    num_layers=3,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(2, 16, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)
SmallMachine = cache_machine(
    SMALL, [[i] * SMALL_PAGE for i in range(3)], max_chunk_tokens=40, max_evict_pages=6, warm_up=False
)
TestCacheMachine = SmallMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

# Page 4, window 4: pieces of 25 to 330 pages, so one prompt can be 1300 pages.
LARGE_PAGE = 4
LARGE = PoolLayout(
    page_size=LARGE_PAGE,
    window=4,
    num_virtual_pages=2400,
    num_swa_pages=2400,
    num_layers=2,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(1, 4, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)
LARGE_PIECES = [
    [1000 * piece + page for page in range(num_pages) for _ in range(LARGE_PAGE)]
    for piece, num_pages in enumerate((25, 60, 150, 330))
]
LargeMachine = cache_machine(LARGE, LARGE_PIECES, max_chunk_tokens=6000, max_evict_pages=64, warm_up=True)
TestLargeCacheMachine = LargeMachine.TestCase
TestLargeCacheMachine.settings = settings(max_examples=10, stateful_step_count=30, deadline=None)
