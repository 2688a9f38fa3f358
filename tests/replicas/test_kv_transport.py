"""The payload's flat buffer and torch.distributed point-to-point (gloo, two ranks) carry a real payload
byte for byte. Ray's object store is tested across processes in tests/platform/launch/test_disaggregated.py,
where Ray is up anyway."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig
from antumbra.replicas.kv_transfer.payload import KVPayload
from antumbra.replicas.kv_transfer.transport import (
    TorchDistTransport,
    pack,
    unpack,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a loaded 2-core machine two OpenMP threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def payload(tiny_checkpoint) -> KVPayload:
    engine = Engine.from_pretrained(
        tiny_checkpoint, cache=CacheConfig(num_virtual_tokens=2048), numerics="release"
    )
    prompt = torch.randint(5, 261, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    return engine.disaggregation.prefill_export(prompt, GREEDY)


def assert_same(a: KVPayload, b: KVPayload) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids and a.first_token == b.first_token
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():
        assert t.dtype == b.tensors[name].dtype and torch.equal(t, b.tensors[name]), name


def test_pack_round_trip(payload):
    header, specs, buffer = pack(payload)
    assert buffer.numel() == payload.nbytes and not header.tensors
    assert_same(unpack(header, specs, buffer), payload)


def test_gloo_point_to_point(payload):
    store = dist.HashStore()
    got: dict[str, KVPayload] = {}
    tickets: list = []
    ready = threading.Event()

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))
        if r == 0:
            sender = TorchDistTransport(group, rank=0, peer=1)
            tickets.append(sender.send(payload))
            ready.set()
            sender.wait_sent()
        else:
            ready.wait(30)
            got["payload"] = TorchDistTransport(group, rank=1, peer=0).receive(tickets[0])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_same(got["payload"], payload)
