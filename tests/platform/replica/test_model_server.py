"""The model server without Ray: when its engine fails, a failed step is a 500 item naming the
request, a stopped engine a 503 item the ingress may retry elsewhere, and its health check fails so
that Serve replaces the replica; once ready it can freeze its start-up heap; it hands out the TTFTs
and inter-chunk gaps it measured of its own streams."""

from __future__ import annotations

import asyncio
import gc

import pytest

from antumbra.config import SchedulerConfig
from antumbra.platform.messages import ENGINE_ERROR, REPLICA_UNAVAILABLE, GenerateRequest
from antumbra.platform.replica.model_server import ModelServer
from antumbra.replicas.errors import EngineDeadError
from antumbra.replicas.sampling_params import SamplingParams
from tests.faults.injection import injected

POISON = 6
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _server(tiny_checkpoint) -> ModelServer:
    return ModelServer("tiny", str(tiny_checkpoint),
                       engine_kwargs={"scheduler": SchedulerConfig(max_model_len=512)})


def _items(server: ModelServer, request_id: str, token_ids: list[int]) -> list[dict]:
    async def collect() -> list[dict]:
        request = GenerateRequest(request_id, token_ids, PARAMS, namespace="tiny:test")
        return [dict(item) async for item in server.generate(request)]

    return asyncio.run(collect())


@injected(f"raise={POISON}")
def test_a_failed_step_is_a_500_naming_the_request_and_the_server_stays_healthy(tiny_checkpoint):
    server = _server(tiny_checkpoint)
    items = _items(server, "cmpl-poisoned", [7, POISON, 8])
    assert len(items) == 1 and items[0]["status"] == 500
    assert items[0]["error"]["code"] == ENGINE_ERROR and "cmpl-poisoned" in items[0]["error"]["message"]
    assert _items(server, "cmpl-fine", [7, 8, 9])[-1]["finish_reason"] == "length"
    asyncio.run(server.check_health())
    server.engine.check_integrity()


@injected(f"fatal={POISON}")
def test_a_stopped_engine_answers_503_and_fails_its_health_check(tiny_checkpoint):
    server = _server(tiny_checkpoint)
    asyncio.run(server.check_health())
    first = _items(server, "cmpl-fatal", [7, POISON, 8])
    assert first[0]["status"] == 503 and first[0]["error"]["code"] == REPLICA_UNAVAILABLE
    later = _items(server, "cmpl-later", [7, 8, 9])
    assert later[0]["status"] == 503 and later[0]["error"]["code"] == REPLICA_UNAVAILABLE
    with pytest.raises(EngineDeadError):
        asyncio.run(server.check_health())


def test_a_server_that_freezes_its_heap_keeps_start_up_objects_out_of_collections(tiny_checkpoint):
    """After `freeze_heap` a full collection walks only what serving allocated since."""
    assert gc.get_freeze_count() == 0
    try:
        server = ModelServer("tiny", str(tiny_checkpoint), freeze_heap=True,
                             engine_kwargs={"scheduler": SchedulerConfig(max_model_len=512)})
        frozen = gc.get_freeze_count()
        assert frozen > 10_000 and len(gc.get_objects()) < frozen / 10
        stats = asyncio.run(server.engine_stats())
        # Frozen objects leave the permanent generation only when freed: the count may fall a little.
        assert 0.99 * frozen <= stats["gc_frozen_objects"] <= frozen
        assert _items(server, "cmpl-after", [7, 8, 9])[-1]["finish_reason"] == "length"
    finally:
        gc.unfreeze()  # this test process builds engine after engine (heap.py)


def test_the_server_hands_out_each_streams_ttft_and_gaps_once(tiny_checkpoint):
    """One TTFT a request and one gap between each two chunks that carried tokens: a stream of 4
    tokens one a step gives 3 gaps. Samples are handed out once, and the recent TTFTs feed the
    autoscaling metric."""
    server = _server(tiny_checkpoint)
    try:
        assert server.take_ttft_samples() == [] and server.take_gap_samples() == []
        items = [_items(server, f"cmpl-gap-{i}", [7, 8, 9 + i]) for i in range(2)]
        chunks = [sum(1 for item in one if item["token_ids"]) for one in items]
        assert all(sum(len(item["token_ids"]) for item in one) == 4 for one in items)
        ttfts, gaps = server.take_ttft_samples(), server.take_gap_samples()
        assert len(ttfts) == 2 and all(t > 0 for t in ttfts)
        assert len(gaps) == sum(c - 1 for c in chunks) and all(g >= 0 for g in gaps)
        assert server.take_ttft_samples() == [] and server.take_gap_samples() == []
        stats = asyncio.run(server.record_autoscaling_stats())
        assert stats["ttft_p90_s"] == max(ttfts)  # nearest rank of two samples
    finally:
        server.engine.shutdown()
