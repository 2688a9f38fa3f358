"""The prefix directory sharded over three redis-servers, wired through the platform config: real
Ray Serve, three replicas of the tiny model, the official `openai` client.

Each replica publishes to the shard `shard_index(replica_id)` names, the platform's own Redis
(tenants, limits, usage) holds no directory key, and a lookup over the shards (what the router
does) finds every prompt on the replica that computed it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis

from antumbra.cachestore.block_hash import block_hashes
from antumbra.platform.ingress.tenants import TenantStore
from antumbra.platform.launch.redis_server import LocalRedis, free_port
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform
from antumbra.platform.routing.directory import PrefixDirectory, shard_index
from antumbra.platform.routing.sharded_directory import ShardedDirectory
from antumbra.replicas.model.tokenizer import Tokenizer
from tests.waiting import wait_until

MODEL = "tiny"
SHARDS = 3
# 427 tokens: three full pages and a part one. (A prompt of whole pages finds none cached: its last
# page is always computed again, and the window rows a shorter match needs are gone once it finished.)
LINES = "".join(f"line {i}: the quick brown fox jumps over the lazy dog. " for i in range(30))
PROMPTS = [f"prompt {k}: {LINES}" for k in range(4)]


@pytest.fixture(scope="module")
def shards() -> Iterator[list[LocalRedis]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(LocalRedis()) for _ in range(SHARDS)]


@pytest.fixture(scope="module")
def running(tiny_checkpoint: Path, shards: list[LocalRedis]) -> Iterator[RunningPlatform]:
    # A lookup bound for a shared 2-core machine (three shards answer in parallel; the default bound
    # is for a served deployment), and no credit for recent routes: only the directory steers.
    spec = {"path": str(tiny_checkpoint), "replicas": 3, "max_model_len": 1024,
            "router_kwargs": {"lookup_timeout_s": 1.0, "recent_ttl_s": 0}}
    config = {"models": {MODEL: spec},
              "directory_redis_urls": [s.url for s in shards]}
    with local_platform(config, port=free_port(), num_cpus=2) as platform:
        yield platform


async def _replica_ids(url: str, prefix: str) -> set[str]:
    """The replicas with a liveness key on one Redis (`P:replica:M:<id>`)."""
    client = aioredis.Redis.from_url(url)
    try:
        head = f"{prefix}:replica:{MODEL}:"
        return {key.decode()[len(head):] async for key in client.scan_iter(f"{head}*")}
    finally:
        await client.aclose()


async def _count_keys(url: str, pattern: str) -> int:
    client = aioredis.Redis.from_url(url)
    try:
        return len([key async for key in client.scan_iter(pattern)])
    finally:
        await client.aclose()


def _lookup(
    platform: RunningPlatform, shard_urls: list[str], replicas: set[str], prompt: str
) -> dict[str, int]:
    """The prompt's match over the sharded directory, as the router looks it up."""
    config = platform.config
    token_ids = Tokenizer.from_dir(config.models[0].path).encode(prompt)

    async def run() -> dict[str, int]:
        main = aioredis.Redis.from_url(platform.redis_url)
        clients = [aioredis.Redis.from_url(url) for url in shard_urls]
        try:
            namespace = (await TenantStore(main, config.key_prefix).get("default")).cache_namespace
            directory = ShardedDirectory(
                [PrefixDirectory(c, MODEL, prefix=config.key_prefix, op_timeout_s=2.0) for c in clients])
            matched = await directory.lookup(block_hashes(token_ids, 128, f"{MODEL}:{namespace}"), replicas)
            assert matched is not None, "the sharded directory did not answer"
            return matched
        finally:
            for client in [main, *clients]:
                await client.aclose()

    return asyncio.run(run())


def test_replicas_publish_to_their_shards_and_the_router_reads_them(
    running: RunningPlatform, shards: list[LocalRedis]
) -> None:
    assert running.config.directory_redis_urls == tuple(s.url for s in shards)
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=running.api_key, max_retries=0,
                           timeout=120)
    prefix, urls = running.config.key_prefix, [s.url for s in shards]

    def every_replica_published() -> bool:
        return sum(len(asyncio.run(_replica_ids(url, prefix))) for url in urls) == 3

    wait_until(every_replica_published, 60, "three replicas in the sharded directory", poll_s=0.2)
    by_shard = [asyncio.run(_replica_ids(url, prefix)) for url in urls]
    replicas = set().union(*by_shard)
    for index, ids in enumerate(by_shard):  # each replica on its own shard, and only there
        assert all(shard_index(rid, SHARDS) == index for rid in ids), (index, ids)
    print(f"\nreplicas per shard: {[len(ids) for ids in by_shard]}")

    holders = []
    for prompt in PROMPTS:
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage is not None and first.usage.prompt_tokens_details.cached_tokens == 0

        def listed(prompt: str = prompt) -> bool:
            matched = _lookup(running, urls, replicas, prompt)
            return len(matched) == 1 and min(matched.values()) >= 3

        wait_until(listed, 30, "the prompt's blocks in the sharded directory", poll_s=0.2)
        holder = next(iter(_lookup(running, urls, replicas, prompt)))
        holders.append(holder)
        # Its blocks are on the holder's shard; the router finds them there and sends the repeat
        # to the holder (the only replica that can reuse the prompt).
        shard_url = urls[shard_index(holder, SHARDS)]
        assert asyncio.run(_count_keys(shard_url, f"{prefix}:rblk:{MODEL}:{holder}")) == 1
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens >= 3 * 128
    print(f"prompts' holders on shards {[shard_index(h, SHARDS) for h in holders]}")
    # The platform's own Redis keeps tenants and limits, no directory entry.
    assert asyncio.run(_count_keys(running.redis_url, f"{prefix}:blk:*")) == 0
    assert asyncio.run(_count_keys(running.redis_url, f"{prefix}:replica:*")) == 0
    # With more than one shard holding replicas, the entries are spread over them.
    holding = {i for i, ids in enumerate(by_shard) if ids}
    blocks = [asyncio.run(_count_keys(url, f"{prefix}:blk:{MODEL}:*")) for url in urls]
    assert {i for i, n in enumerate(blocks) if n} == {shard_index(h, SHARDS) for h in holders} <= holding


def test_the_shards_are_read_from_config_and_flags() -> None:
    import argparse

    from antumbra.platform.launch.platform_config import PlatformConfig
    from antumbra.platform.launch.serve_cli import add_serve

    base = {"redis_url": "redis://main:6379/0", "models": {"m": {"path": "p"}}}
    config = PlatformConfig.from_dict({**base, "directory_redis_urls": ["redis://d0/0", "redis://d1/0"]})
    assert config.directory_redis_urls == ("redis://d0/0", "redis://d1/0")
    assert PlatformConfig.from_dict(base).directory_redis_urls == ()
    with pytest.raises(ValueError, match="directory_redis_urls"):
        PlatformConfig.from_dict({**base, "directory_redis_urls": ["redis://d0/0", ""]})
    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--directory-redis-url", "redis://d0/0", "--directory-redis-url",
                              "redis://d1/0"])
    assert args.directory_redis_urls == ["redis://d0/0", "redis://d1/0"]
