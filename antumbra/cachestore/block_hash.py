"""Block hashes and block events: the one key the cache and the prefix directory share.

A prompt is cut into page-sized blocks of token ids; each FULL block gets a 64-bit hash
chained over every block before it and seeded with the cache namespace:

    seed      = blake2b(namespace.encode("utf-8"), digest_size=8, person=SEED_PERSON)
    h_0       = blake2b(pack(block_0), digest_size=8, key=seed,    person=BLOCK_PERSON)
    h_i       = blake2b(pack(block_i), digest_size=8, key=h_{i-1}, person=BLOCK_PERSON)

where `pack` writes the block's token ids as little-endian int64 and every 8-byte value is
read and written little-endian. The partial last block gets no hash. So a hash names a whole
prefix (every token before and in its block, and the namespace), is the same in every process
on every machine (unlike Python's salted `hash`), and two namespaces never share one.

A namespace is a string such as ``f"{model}:{tenant_salt}"``; the server derives it, a client
never supplies it.

Block events are what a replica's cache publishes so the directory stays true:
`BlockStored`, `BlockRemoved` (each with the tier the blocks are in) and `AllCleared`,
grouped in an `EventBatch` that carries the replica's id and a per-replica sequence number.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Literal, get_args

SEED_PERSON = b"antumbra.ns.v1"
BLOCK_PERSON = b"antumbra.blk.v1"

Tier = Literal["device", "host"]
TIERS: tuple[str, ...] = get_args(Tier)


def namespace_seed(namespace: str) -> int:
    """The chain's starting value for a namespace (the parent of block 0)."""
    digest = blake2b(namespace.encode("utf-8"), digest_size=8, person=SEED_PERSON).digest()
    return int.from_bytes(digest, "little")


def _packed(token_ids: Sequence[int]) -> memoryview:
    if hasattr(token_ids, "tolist"):  # numpy arrays and torch tensors: one C-level conversion
        token_ids = token_ids.tolist()
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return memoryview(packed).cast("B")


def extend_block_hashes(parent: int, token_ids: Sequence[int], page_size: int) -> list[int]:
    """Continue a chain: hashes of the full blocks of `token_ids`, the first chained to `parent`.

    `extend_block_hashes(block_hashes(a, P, ns)[-1], b, P)` equals the tail of
    `block_hashes(a + b, P, ns)` when `len(a)` is a multiple of `P`.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    num_blocks = len(token_ids) // page_size
    if num_blocks == 0:
        return []
    data = _packed(token_ids[: num_blocks * page_size])
    step = page_size * 8
    out: list[int] = []
    key = parent.to_bytes(8, "little")
    for start in range(0, num_blocks * step, step):
        key = blake2b(data[start : start + step], digest_size=8, key=key, person=BLOCK_PERSON).digest()
        out.append(int.from_bytes(key, "little"))
    return out


def block_hashes(token_ids: Sequence[int], page_size: int, namespace: str) -> list[int]:
    """One chained 64-bit hash per full `page_size` block of `token_ids`, seeded with `namespace`."""
    return extend_block_hashes(namespace_seed(namespace), token_ids, page_size)


def hash_hex(h: int) -> str:
    """The 16-digit hex form of a block hash used in JSON and in Redis keys."""
    return f"{h:016x}"


# --------------------------------------------------------------------------- events


def _check_event(hashes: tuple[int, ...], tier: str) -> None:
    if not isinstance(hashes, tuple):
        raise TypeError(f"hashes must be a tuple of ints, got {type(hashes).__name__}")
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks (by hash) that now hold KV in `tier` on the publishing replica."""

    hashes: tuple[int, ...]
    tier: Tier = "device"

    def __post_init__(self) -> None:
        _check_event(self.hashes, self.tier)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks (by hash) no longer held in `tier` on the publishing replica."""

    hashes: tuple[int, ...]
    tier: Tier = "device"

    def __post_init__(self) -> None:
        _check_event(self.hashes, self.tier)


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The publishing replica dropped every cached block in every tier."""


BlockEvent = BlockStored | BlockRemoved | AllCleared

_TIER_CODE = {"device": "d", "host": "h"}
_CODE_TIER = {v: k for k, v in _TIER_CODE.items()}


def _encode_event(event: BlockEvent) -> list[Any]:
    if isinstance(event, AllCleared):
        return ["c"]
    op = "s" if isinstance(event, BlockStored) else "r"
    return [op, _TIER_CODE[event.tier], *(hash_hex(h) for h in event.hashes)]


def _decode_event(item: Any) -> BlockEvent:
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise ValueError(f"malformed block event: {item!r}")
    op = item[0]
    if op == "c":
        if len(item) != 1:
            raise ValueError(f"malformed clear event: {item!r}")
        return AllCleared()
    if op not in ("s", "r") or len(item) < 2 or item[1] not in _CODE_TIER:
        raise ValueError(f"malformed block event: {item!r}")
    try:
        hashes = tuple(int(h, 16) for h in item[2:])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed block hash in {item!r}") from exc
    if any(h >> 64 for h in hashes):
        raise ValueError(f"block hash wider than 64 bits in {item!r}")
    tier = _CODE_TIER[item[1]]
    return BlockStored(hashes, tier) if op == "s" else BlockRemoved(hashes, tier)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one replica, in order; `seq` grows by one per batch the replica publishes.

    JSON form (compact): ``{"r": replica_id, "s": seq, "e": [["s", "d", "<hex>", ...],
    ["r", "h", "<hex>", ...], ["c"]]}`` where ``s``/``r``/``c`` are stored / removed /
    cleared, ``d``/``h`` the device / host tier and each hash is 16 hex digits.
    """

    replica_id: str
    seq: int
    events: tuple[BlockEvent, ...]

    def to_json(self) -> str:
        body = {"r": self.replica_id, "s": self.seq, "e": [_encode_event(e) for e in self.events]}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EventBatch:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"event batch is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ValueError("event batch must be a JSON object")
        replica_id, seq, events = body.get("r"), body.get("s"), body.get("e")
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError("event batch needs a non-empty string 'r' (replica id)")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError("event batch needs a non-negative integer 's' (sequence number)")
        if not isinstance(events, list):
            raise ValueError("event batch needs a list 'e' (events)")
        return cls(replica_id, seq, tuple(_decode_event(e) for e in events))
