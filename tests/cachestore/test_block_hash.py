"""Block hashes: stable across processes, namespaced, chained; block events round-trip through JSON."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array
from hashlib import blake2b
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from antumbra.cachestore import block_hash as bh
from antumbra.cachestore.block_hash import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_hashes,
    extend_block_hashes,
    namespace_seed,
)

TOKENS = list(range(1000, 1000 + 16 * 5 + 7))  # five full blocks of 16 and a partial one


def test_same_hashes_in_another_process_with_another_hash_seed() -> None:
    # The child loads the module file on its own (no package import) under a different
    # PYTHONHASHSEED, so Python's salted `hash` could not produce equal values by chance.
    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('bh', {str(Path(bh.__file__))!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['bh'] = m; spec.loader.exec_module(m)\n"
        f"print(json.dumps(m.block_hashes({TOKENS!r}, 16, 'tiny:tenant-a')))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout) == block_hashes(TOKENS, 16, "tiny:tenant-a")


def test_golden_values_never_change() -> None:
    # Directory entries written by one version must be found by the next: pin the function,
    # and check it against the formula in the module docstring.
    assert namespace_seed("m:salt") == 0x83CBFE8082CFA824
    got = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "m:salt")
    assert [f"{h:016x}" for h in got] == ["7fd055c64e266368", "ea4e547129e7c07f"]

    key = blake2b(b"m:salt", digest_size=8, person=b"antumbra.ns.v1").digest()
    expected = []
    for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in block)
        key = blake2b(data, digest_size=8, key=key, person=b"antumbra.blk.v1").digest()
        expected.append(int.from_bytes(key, "little"))
    assert got == expected


def test_one_hash_per_full_block_partial_block_ignored() -> None:
    hashes = block_hashes(TOKENS, 16, "tiny:tenant-a")
    assert len(hashes) == 5
    assert block_hashes(TOKENS[:80], 16, "tiny:tenant-a") == hashes
    assert block_hashes(TOKENS[:79], 16, "tiny:tenant-a") == hashes[:4]
    assert block_hashes(TOKENS[:15], 16, "tiny:tenant-a") == []
    assert block_hashes([], 16, "tiny:tenant-a") == []
    assert all(0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == 5
    with pytest.raises(ValueError):
        block_hashes(TOKENS, 0, "x")


def test_namespace_changes_every_hash() -> None:
    a = block_hashes(TOKENS, 16, "tiny:tenant-a")
    b = block_hashes(TOKENS, 16, "tiny:tenant-b")
    c = block_hashes(TOKENS, 16, "other-model:tenant-a")
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_chained_a_change_moves_every_later_hash_and_no_earlier_one() -> None:
    base = block_hashes(TOKENS, 16, "ns")
    for block in range(5):
        changed = list(TOKENS)
        changed[block * 16 + 3] += 1
        other = block_hashes(changed, 16, "ns")
        assert other[:block] == base[:block]
        assert all(x != y for x, y in zip(other[block:], base[block:], strict=True))
    # The same block content at another position hashes differently.
    repeated = [7] * 64
    assert len(set(block_hashes(repeated, 16, "ns"))) == 4


def test_extend_continues_the_chain_and_inputs_of_any_sequence_type() -> None:
    full = block_hashes(TOKENS, 16, "ns")
    head = block_hashes(TOKENS[:32], 16, "ns")
    assert head + extend_block_hashes(head[-1], TOKENS[32:], 16) == full
    assert extend_block_hashes(namespace_seed("ns"), TOKENS, 16) == full
    assert block_hashes(tuple(TOKENS), 16, "ns") == full
    assert block_hashes(array("i", TOKENS), 16, "ns") == full

    class TensorLike(list):  # numpy arrays and torch tensors expose tolist()
        def tolist(self) -> list[int]:
            return list(self)

    assert block_hashes(TensorLike(TOKENS), 16, "ns") == full
    big = [2**40 + 1] * 16  # ids beyond int32 are hashed, not truncated
    assert block_hashes(big, 16, "ns") != block_hashes([1] * 16, 16, "ns")


def test_100k_tokens_give_one_distinct_hash_per_full_page() -> None:
    # How long this takes is measured in benchmarks/cache/block_hash.py, not asserted here.
    rng = random.Random(0)
    tokens = [rng.randrange(200_000) for _ in range(100_000 + 7)]  # a partial last page
    for page_size in (16, 256):
        hashes = block_hashes(tokens, page_size, "tiny:tenant-a")
        assert len(hashes) == 100_007 // page_size
        assert len(set(hashes)) == len(hashes)


def test_event_batch_json_round_trip() -> None:
    hashes = tuple(block_hashes(TOKENS, 16, "ns"))
    batch = EventBatch(
        "replica-1",
        42,
        (BlockStored(hashes[:3]), BlockStored(hashes[3:], "host"), BlockRemoved(hashes[:1]), AllCleared()),
    )
    text = batch.to_json()
    assert EventBatch.from_json(text) == batch
    assert EventBatch.from_json(text.encode()) == batch
    assert " " not in text
    body = json.loads(text)
    assert body["r"] == "replica-1" and body["s"] == 42
    assert body["e"][0][:3] == ["s", "d", f"{hashes[0]:016x}"]
    assert body["e"][-1] == ["c"]
    assert EventBatch.from_json(EventBatch("r", 0, ()).to_json()) == EventBatch("r", 0, ())


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"r": "", "s": 0, "e": []}',
        '{"r": "a", "s": -1, "e": []}',
        '{"r": "a", "s": true, "e": []}',
        '{"r": "a", "s": 0, "e": {}}',
        '{"r": "a", "s": 0, "e": [["x", "d"]]}',
        '{"r": "a", "s": 0, "e": [["s", "gpu", "00"]]}',
        '{"r": "a", "s": 0, "e": [["s", "d", "zz"]]}',
        '{"r": "a", "s": 0, "e": [["s", "d", "1ffffffffffffffff"]]}',
        '{"r": "a", "s": 0, "e": [["c", "d"]]}',
        '{"r": "a", "s": 0, "e": [[]]}',
    ],
)
def test_malformed_batches_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        EventBatch.from_json(text)


def test_events_validate_their_fields() -> None:
    with pytest.raises(ValueError):
        BlockStored((1,), "gpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockRemoved([1, 2])  # type: ignore[arg-type]


_hashes = st.lists(st.integers(0, 2**64 - 1), max_size=8).map(tuple)
_event = st.one_of(
    st.builds(BlockStored, _hashes, st.sampled_from(["device", "host"])),
    st.builds(BlockRemoved, _hashes, st.sampled_from(["device", "host"])),
    st.just(AllCleared()),
)


@given(st.text(min_size=1, max_size=20), st.integers(0, 2**62), st.lists(_event, max_size=6).map(tuple))
def test_event_batch_round_trip_property(replica_id: str, seq: int, events: tuple[object, ...]) -> None:
    batch = EventBatch(replica_id, seq, events)  # type: ignore[arg-type]
    assert EventBatch.from_json(batch.to_json()) == batch
