"""A model served with its engine in a process of its own (`engine_process: true`): real Ray Serve, a
real redis-server and the tiny model, through the official openai client.

One app serves the same checkpoint twice, the engine in the replica and in its own process: greedy
answers are the same text, streamed or not; the replica reports its engine's process; the engine
process publishes its cache to the prefix directory; a dropped stream aborts its request there;
and when the engine process dies, its stream ends with an error and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform
from tests.openai_clients import platform_client as client
from tests.waiting import wait_until

IN_REPLICA, OWN = "tiny", "tiny-process"
PROMPT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog. " for i in range(30))


@pytest.fixture(scope="module")
def platform(tiny_checkpoint: Path) -> Iterator[RunningPlatform]:
    models = {IN_REPLICA: {"path": str(tiny_checkpoint), "max_model_len": 4096},
              OWN: {"path": str(tiny_checkpoint), "max_model_len": 4096, "engine_process": True,
                    "health_check_period_s": 1.0, "health_check_timeout_s": 10.0}}
    with local_platform({"models": models}, port=free_port(), num_cpus=2) as running:
        assert running.api_key is not None
        yield running


def replica_state(platform: RunningPlatform) -> dict[str, Any]:
    r = httpx.get(f"{platform.base_url}/admin/models/{OWN}/replicas",
                  headers={"Authorization": f"Bearer {platform.admin_key}"}, timeout=30)
    assert r.status_code == 200, r.text
    replicas = r.json()["data"]
    assert len(replicas) == 1, replicas
    return replicas[0]


def test_answers_are_the_in_replica_engines_text(platform: RunningPlatform) -> None:
    texts = {}
    for model in (IN_REPLICA, OWN):
        whole = client(platform).completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                                    extra_body={"ignore_eos": True})
        assert whole.usage is not None and whole.usage.completion_tokens == 24
        stream = client(platform).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=16,
            temperature=0, stream=True, extra_body={"ignore_eos": True, "thinking": {"type": "disabled"}})
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        texts[model] = (whole.choices[0].text, streamed)
    assert texts[OWN] == texts[IN_REPLICA]
    state = replica_state(platform)
    assert state["engine_pid"] != state["pid"]


def test_the_engine_process_publishes_its_cache_to_the_directory(platform: RunningPlatform) -> None:
    from antumbra.cachestore.block_hash import block_hashes
    from antumbra.platform.routing.directory import PrefixDirectory
    from antumbra.replicas.model.tokenizer import Tokenizer

    prompt = f"{time.time_ns()} {PROMPT}"
    first = client(platform).completions.create(model=OWN, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 2 * 128
    state = replica_state(platform)
    config = platform.config
    token_ids = Tokenizer.from_dir(config.models[0].path).encode(prompt)

    def listed() -> bool:
        import redis.asyncio as aioredis

        from antumbra.platform.ingress.tenants import TenantStore

        async def lookup() -> dict[str, int] | None:
            redis = aioredis.Redis.from_url(platform.redis_url)
            try:
                tenants = await TenantStore(redis, config.key_prefix).list()
                namespace = tenants[0].cache_namespace
                hashes = block_hashes(token_ids, 128, f"{OWN}:{namespace}")
                directory = PrefixDirectory(redis, OWN, prefix=config.key_prefix, op_timeout_s=2.0)
                return await directory.lookup(hashes, {state["replica_id"]})
            finally:
                await redis.aclose()

        return bool(asyncio.run(lookup()))

    wait_until(listed, 10, "the prompt's blocks in the prefix directory", poll_s=0.2)


def test_a_dropped_stream_aborts_its_request_in_the_engine_process(platform: RunningPlatform) -> None:
    body = {"model": OWN, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{platform.base_url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {platform.api_key}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped line iterator closes the response
        next(line for line in lines if line.startswith("data: "))
        assert replica_state(platform)["request_ids"]
    wait_until(lambda: replica_state(platform)["request_ids"] == [], 10, "the engine process to abort it")


def test_a_dead_engine_process_ends_its_stream_and_the_replica_is_replaced(platform: RunningPlatform) -> None:
    before = replica_state(platform)
    stream = client(platform).completions.create(model=OWN, prompt="go on", max_tokens=2000, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    os.kill(before["engine_pid"], signal.SIGKILL)  # this test's machine runs the replica
    with pytest.raises(openai.APIError):
        for _ in chunks:
            continue

    def replaced() -> bool:
        try:
            return replica_state(platform)["replica_id"] != before["replica_id"]
        except AssertionError:  # between the old replica and the new one
            return False

    wait_until(replaced, 120, "Serve to replace the replica whose engine died", poll_s=1.0)
    after = client(platform).completions.create(model=OWN, prompt=PROMPT, max_tokens=4, temperature=0)
    assert after.usage is not None and after.usage.completion_tokens == 4


def test_the_serve_flag_turns_it_on_and_a_multi_rank_replica_refuses_it(tiny_checkpoint: Path) -> None:
    from antumbra.cli import build_parser
    from antumbra.platform.launch.platform_config import PlatformConfig
    from antumbra.platform.launch.serve_cli import config_from_args

    args = build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--engine-process"])
    data = config_from_args(args)
    config = PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0", **data})
    assert config.models[0].engine_process and config.models[0].replica_kwargs()["engine_process"]
    plain = config_from_args(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint)]))
    assert "engine_process" not in next(iter(plain["models"].values()))

    def resolved(**spec: Any) -> bool | None:
        models = {"m": {"path": str(tiny_checkpoint), **spec}}
        config = PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0", "models": models})
        return config.models[0].engine_process

    # Unset: on for a CUDA replica over one rank, off on the CPU and for parallel or split replicas.
    assert resolved(device="cuda") is True and resolved() is False
    assert resolved(device="cuda", tensor_parallel_size=2) is False
    assert resolved(device="cuda", engine_process=False) is False
    disaggregated = {"disaggregation": {"prefill_replicas": 1, "decode_replicas": 1}}
    for split in ({"tensor_parallel_size": 2}, disaggregated):
        with pytest.raises(ValueError, match="engine_process"):
            PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0", "models": {
                "m": {"path": str(tiny_checkpoint), "engine_process": True, **split}}})
