"""Random admit / compute / finish / abort / evict sequences against ShadowRadix and the pools,
with every invariant checked after every step (a hypothesis state machine, no model needed)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from antumbra.cachestore.pools import CompressorSpec, KVPools, PoolLayout
from antumbra.cachestore.shadow_radix import ShadowRadix
from antumbra.replicas.kv_manager import KVManager
from antumbra.replicas.request import Request
from antumbra.replicas.sampling_params import SamplingParams

PAGE = 16
LAYOUT = PoolLayout(
    page_size=PAGE,
    window=8,
    num_virtual_pages=24,
    num_swa_pages=9,
    num_layers=3,
    head_dim=4,
    index_head_dim=4,
    compressors=(CompressorSpec(0, 4, 2, 4), CompressorSpec(2, 16, 1, 4)),
    indexers=(CompressorSpec(0, 4, 2, 4),),
)
# Prompts are built from a few shared page-sized pieces so that prefixes collide.
PIECES = [[i] * PAGE for i in range(3)]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pools = KVPools(LAYOUT, torch.float32, "cpu")
        self.tree = ShadowRadix(self.pools)
        self.kv = KVManager(self.pools, self.tree, LAYOUT.num_layers, enable_replay=True)
        self.running: list[Request] = []
        self.ids = 0

    @rule(
        pieces=st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=4),
        tail=st.integers(1, PAGE),
        namespace=st.sampled_from(["a", "b"]),
    )
    def admit(self, pieces, tail, namespace):
        prompt = [t for i in pieces for t in PIECES[i]] + [7] * tail
        self.ids += 1
        request = Request(f"r{self.ids}", prompt, SamplingParams(), None, None, namespace=namespace)
        self.kv.admit(request)
        assert request.num_computed_tokens % PAGE == 0
        assert request.num_computed_tokens < request.num_tokens
        if self.kv.grow(request, request.num_computed_tokens + 1):
            self.running.append(request)
        else:
            self.kv.release(request, cache=False)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 50), count=st.integers(1, 40))
    def compute(self, which, count):
        request = self.running[which % len(self.running)]
        count = min(count, request.num_tokens - request.num_computed_tokens)
        if count == 0:
            request.output_token_ids.append(9)
            return
        if request.replay_until > request.num_computed_tokens:
            count = min(count, request.replay_until - request.num_computed_tokens)
        if self.kv.grow(request, request.num_computed_tokens + count):
            request.num_computed_tokens += count
            self.kv.release_slid_out(request)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 50), cache=st.booleans())
    def finish_or_abort(self, which, cache):
        request = self.running.pop(which % len(self.running))
        self.kv.release(request, cache=cache)

    @rule(count=st.integers(1, 6))
    def evict_full(self, count):
        self.tree.evict_full(count)

    @rule(count=st.integers(1, 6))
    def evict_swa(self, count):
        self.tree.evict_swa(count)

    @invariant()
    def integrity(self):
        self.kv.check_integrity(self.running)
        for request in self.running:
            own = request.vpages[len(request.shared_path) :]
            held = self.pools.num_swa_pages_of(own) + len(request.swa_locked)
            assert held <= LAYOUT.steady_swa_pages_per_seq

    def teardown(self):
        for request in self.running:
            self.kv.release(request)
        self.tree.clear()
        self.kv.check_integrity([])
        assert self.pools.num_free_virtual_pages == LAYOUT.num_virtual_pages
        assert self.pools.num_free_swa_pages == LAYOUT.num_swa_pages


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
