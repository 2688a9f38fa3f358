"""Usage metering and the supervised Redis end to end: real Ray Serve, the platform's own
redis-server (persisted, supervised) and the tiny model, through HTTP, the openai client and the CLI.

One app serves the module; a test that breaks something (the ingress, Redis) waits until it is
back before it ends, so the tests pass in any order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from antumbra.cli import main as cli_main
from antumbra.platform.ingress.usage_open import MAX_UNWRITTEN_TOKENS, STALE_AFTER_S
from antumbra.platform.ingress.usage_sweep import SWEEP_EVERY_S
from antumbra.platform.launch.redis_server import HOST, free_port, ping
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform
from tests.waiting import wait_until

MODEL = "tiny"
TENANTS = ("alpha", "beta")
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
LONG_RUN = {"model": MODEL, "prompt": "go on", "max_tokens": 800, "ignore_eos": True, "temperature": 0}


@dataclass
class Metered:
    running: RunningPlatform
    keys: dict[str, str]
    log_dir: Path

    @property
    def url(self) -> str:
        return self.running.base_url

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.running.admin_key}"}

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=60)

    def usage(self, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}/admin/usage", params=params, headers=self.admin(), timeout=30)

    def totals(self, tenant: str) -> dict[str, int]:
        r = self.usage(tenant=tenant)
        assert r.status_code == 200, r.text
        sums = r.json()["totals"].get(tenant, {})
        return {k: int(sums.get(k, 0)) for k in COUNTS}

    def admin_answers(self) -> bool:
        """Whether an ingress answers the admin API (a restarted one, after a kill)."""
        try:
            return self.usage(tenant="alpha").status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=10).json())


@pytest.fixture(scope="module")
def metered(tiny_checkpoint: Path) -> Iterator[Metered]:
    import ray

    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "max_model_len": 4096}},
              "stream_idle_timeout_s": 30}
    with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as running:
        keys = {}
        for tenant in TENANTS:
            r = httpx.post(f"{running.base_url}/admin/tenants", json={"id": tenant},
                           headers={"Authorization": f"Bearer {running.admin_key}"}, timeout=30)
            assert r.status_code == 201, r.text
            keys[tenant] = r.json()["api_key"]
        log_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
        yield Metered(running, keys, log_dir)


def added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in COUNTS}


def wait_for_usage(m: Metered, tenant: str, before: dict[str, int], requests: int) -> dict[str, int]:
    """What the tenant's usage grew by once it counts `requests` more requests."""
    wait_until(lambda: m.totals(tenant)["requests"] >= before["requests"] + requests, 30,
               f"{requests} more requests in {tenant}'s usage")
    return added(before, m.totals(tenant))


def test_each_request_is_counted_once_and_the_cli_reads_it(
    metered: Metered, capsys: pytest.CaptureFixture
) -> None:
    before = metered.totals("alpha")
    client = metered.client("alpha")
    messages = [{"role": "user", "content": "count the tokens of this request"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)  # type: ignore
    chunks = list(client.chat.completions.create(  # type: ignore
        model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    streamed = next(c.usage for c in chunks if c.usage is not None)
    assert plain.usage is not None and streamed is not None
    grew = wait_for_usage(metered, "alpha", before, 2)
    assert grew == {
        "requests": 2,
        "prompt_tokens": plain.usage.prompt_tokens + streamed.prompt_tokens,
        "cached_tokens": plain.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
        + streamed.prompt_tokens_details.cached_tokens,  # type: ignore[union-attr]
        "completion_tokens": plain.usage.completion_tokens + streamed.completion_tokens,
    }

    api = metered.usage(tenant="alpha").json()
    argv = ["usage", "--tenant", "alpha", "--url", metered.url, "--admin-key", metered.running.admin_key]
    capsys.readouterr()
    assert cli_main([*argv, "--json"]) == 0
    from_cli = json.loads(capsys.readouterr().out)
    assert from_cli["data"] == api["data"] and from_cli["totals"] == api["totals"]
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["tenant", "model", "hour"]
    total_line = next(line.split() for line in table.splitlines() if "(total)" in line)
    assert total_line[:3] == ["alpha", "(all)", "(total)"]
    assert int(total_line[3]) == api["totals"]["alpha"]["requests"]
    assert cli_main([*argv, "--from", "yesterday"]) == 1
    assert "400" in capsys.readouterr().err


# `</think>` (V4's token 128822) biased so that the random model closes its reasoning after a few
# tokens (e^11 against 129,280 rows: about a third of each step's probability), mid-answer.
END_THINKING = {"128822": 11}


def _reasoning_tokens(tenant: str, m: Metered) -> int:
    return int(m.usage(tenant=tenant).json()["totals"].get(tenant, {}).get("reasoning_tokens", 0))


def test_reasoning_tokens_are_the_completion_tokens_inside_the_reasoning(metered: Metered) -> None:
    client = metered.client("beta")
    messages = [{"role": "user", "content": "think, then answer"}]
    counted = []
    for seed in range(4):
        before, reasoning_before = metered.totals("beta"), _reasoning_tokens("beta", metered)
        out = client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=seed, logprobs=True,
            logit_bias=END_THINKING, extra_body={"thinking": {"type": "enabled"}})
        tokens = [t.token for t in out.choices[0].logprobs.content]
        # The reasoning is every token before the first `</think>`; all of them if it never closed.
        inside = tokens.index("</think>") if "</think>" in tokens else len(tokens)
        assert out.usage.completion_tokens_details.reasoning_tokens == inside
        wait_for_usage(metered, "beta", before, 1)
        assert _reasoning_tokens("beta", metered) - reasoning_before == inside
        counted.append((inside, len(tokens)))
    assert any(0 < inside < total for inside, total in counted), counted  # some closed mid-answer
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,  # type: ignore
                                           extra_body={"thinking": {"type": "disabled"}})
    assert plain.usage is not None and plain.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize(("params", "param"), [({"from": "yesterday"}, "from"), ({"to": "nan"}, "to"),
                                               ({"from": "2026-02-01", "to": "2026-01-01"}, "to")])
def test_bad_usage_queries_get_an_openai_shaped_400(
    metered: Metered, params: dict[str, str], param: str
) -> None:
    r = metered.usage(**params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert httpx.get(f"{metered.url}/admin/usage", timeout=10).status_code == 401
    assert metered.usage(tenant="alpha").status_code == 200  # nothing broken


def _log_sizes(log_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in log_dir.glob("worker-*.err")}


def _new_log_text(log_dir: Path, sizes: dict[Path, int]) -> str:
    text = []
    for path in log_dir.glob("worker-*.err"):
        with open(path, "rb") as f:
            f.seek(sizes.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "".join(text)


def test_a_cut_stream_counts_the_tokens_sent_once_and_logs_one_line(metered: Metered) -> None:
    before = metered.totals("beta")
    sizes = _log_sizes(metered.log_dir)
    headers = {"Authorization": f"Bearer {metered.keys['beta']}"}
    received = 0
    with httpx.stream("POST", f"{metered.url}/v1/completions", json={**LONG_RUN, "stream": True},
                      headers=headers, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            received += line.startswith("data: {")
            if received == 4:
                break
    grew = wait_for_usage(metered, "beta", before, 1)
    assert grew["requests"] == 1 and grew["prompt_tokens"] > 0
    # What was sent before the ingress saw the client go: at least what the client read, not all.
    assert received <= grew["completion_tokens"] < LONG_RUN["max_tokens"], grew
    # A non-streaming request whose client gives up: its prompt counts, no completion (none was sent).
    after_stream = metered.totals("beta")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{metered.url}/v1/completions", json=LONG_RUN, headers=headers,
                   timeout=httpx.Timeout(60, read=1.5))
    plain = wait_for_usage(metered, "beta", after_stream, 1)
    assert plain["requests"] == 1 and plain["prompt_tokens"] > 0 and plain["completion_tokens"] == 0, plain
    wait_until(lambda: "client disconnected from stream" in _new_log_text(metered.log_dir, sizes), 30,
               "the disconnect's log line")
    logged = _new_log_text(metered.log_dir, sizes)
    assert logged.count("client disconnected from stream") == 1, logged
    assert "Traceback" not in logged and "TaskCancelledError" not in logged, logged
    assert metered.totals("beta") == {k: after_stream[k] + plain[k] for k in COUNTS}  # neither again


def test_usage_survives_an_ingress_restart(metered: Metered) -> None:
    import ray

    client = metered.client("alpha")
    client.completions.create(model=MODEL, prompt="before the restart", max_tokens=3)
    wait_until(lambda: metered.health()["usage_pending"] == 0, 30, "usage written")
    before = metered.totals("alpha")
    named = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"])
    ray.kill(ray.get_actor(named["name"], namespace=named["namespace"]), no_restart=True)

    wait_until(metered.admin_answers, 120, "a new ingress replica", poll_s=0.5)
    assert metered.totals("alpha") == before
    done = client.completions.create(model=MODEL, prompt="after the restart", max_tokens=3)
    assert done.usage is not None
    grew = wait_for_usage(metered, "alpha", before, 1)
    assert grew["requests"] == 1 and grew["completion_tokens"] == done.usage.completion_tokens


def test_the_platforms_redis_is_restarted_and_known_tenants_are_served(metered: Metered) -> None:
    redis, supervisor = metered.running.local_redis, metered.running.redis_supervisor
    assert metered.health()["redis_owner"] == "platform"
    client = metered.client("alpha")
    assert client.completions.create(model=MODEL, prompt="known before", max_tokens=2).usage is not None
    before = metered.totals("alpha")
    killed = redis.pid
    os.kill(killed, signal.SIGKILL)
    wait_until(lambda: redis.pid not in (None, killed) and ping(HOST, redis.port), 30, "Redis restarted")
    assert supervisor.restarts >= 1
    # Persisted: tenants, keys and usage are all still there.
    wait_until(lambda: metered.health()["status"] == "ok", 30, "the ingress to see Redis again")
    assert metered.totals("alpha") == before
    for tenant in TENANTS:
        metered.client(tenant).completions.create(model=MODEL, prompt="after the restart", max_tokens=2)

    # A longer outage (no restarts for a while): known keys keep working, usage waits, then lands.
    before = metered.totals("alpha")
    with supervisor.paused():
        redis.kill()
        wait_until(lambda: metered.health()["status"] == "degraded", 30, "the ingress to see the outage")
        health = metered.health()
        assert health["redis"] == "unavailable" and health["auth"] == "known_keys", health
        during = client.completions.create(model=MODEL, prompt="during the outage", max_tokens=3)
        assert metered.health()["usage_pending"] >= 1
        unknown = httpx.post(f"{metered.url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                             headers={"Authorization": "Bearer sk-ant-never-seen"}, timeout=30)
        assert unknown.status_code == 503, unknown.text
    wait_until(lambda: metered.health()["status"] == "ok" and metered.health()["usage_pending"] == 0, 30,
               "Redis back and the queued usage written")
    assert during.usage is not None
    grew = added(before, metered.totals("alpha"))
    assert grew["requests"] == 1 and grew["completion_tokens"] == during.usage.completion_tokens


def test_a_stream_its_replica_failed_counts_exactly_the_tokens_sent(metered: Metered) -> None:
    """The replica dies mid-stream: the stream ends with an error event, and usage counts every token
    the client got (logprobs name each chunk's tokens), once."""
    import ray

    before = metered.totals("beta")
    actors = ray.util.list_named_actors(all_namespaces=True)
    named = next(a for a in actors if f"#Model-{MODEL}#" in a["name"])
    replica = ray.get_actor(named["name"], namespace=named["namespace"])
    body = {**LONG_RUN, "max_tokens": 3000, "stream": True, "logprobs": 1}
    received, events = 0, []
    with httpx.stream("POST", f"{metered.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {metered.keys['beta']}"}, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = line[len("data: "):]
            events.append(event)
            chunk = json.loads(event) if event.startswith("{") else {}
            if chunk.get("choices"):
                received += len(chunk["choices"][0]["logprobs"]["tokens"])
                if len(events) == 8:  # mid-stream, thousands of tokens before its end
                    ray.kill(replica, no_restart=True)
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-2:]
    grew = wait_for_usage(metered, "beta", before, 1)
    assert grew["requests"] == 1 and grew["completion_tokens"] == received, (grew, received)

    def replaced() -> bool:
        try:
            metered.client("beta").completions.create(model=MODEL, prompt="x", max_tokens=1)
        except openai.APIError:
            return False
        return True

    wait_until(replaced, 120, "the replacement replica serving", poll_s=1.0)


@dataclass
class CountedStream:
    """One streamed completion as its client saw it: the tokens its chunks named (logprobs), the usage
    chunk if one came, and how it ended: "done", "error" (an error event) or "broken"."""

    tenant: str
    received: int = 0
    largest_chunk: int = 0  # tokens
    usage: dict[str, int] | None = None
    ended: str = "running"

    @property
    def lag_bound(self) -> int:
        """How far its recorded completion tokens may lag what it received, cut by an ingress crash
        (an entry takes a stream's chunks one delta late: `usage_open`)."""
        return max(MAX_UNWRITTEN_TOKENS, 2 * self.largest_chunk)


def _count_stream(m: Metered, out: CountedStream, body: dict[str, Any]) -> None:
    body = {**body, "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {m.keys[out.tenant]}"}
    events = []
    try:
        with httpx.stream("POST", f"{m.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    events.append(line)
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices"):
                    tokens = len(chunk["choices"][0]["logprobs"]["tokens"])
                    out.received += tokens
                    out.largest_chunk = max(out.largest_chunk, tokens)
                out.usage = chunk.get("usage") or out.usage
                out.ended = "error" if "error" in chunk else out.ended
    except httpx.HTTPError:
        out.ended = "broken"
        return
    if out.ended == "running":
        out.ended = "done" if "data: [DONE]" in events and out.usage is not None else "broken"


def _streams(m: Metered, outs: list[CountedStream], body: dict[str, Any]) -> list[threading.Thread]:
    threads = [threading.Thread(target=_count_stream, args=(m, o, body), daemon=True) for o in outs]
    for t in threads:
        t.start()
    return threads


def _completed(outs: list[CountedStream], tenant: str) -> dict[str, int]:
    done = [o for o in outs if o.tenant == tenant and o.ended == "done"]
    assert all(o.usage is not None and o.usage["completion_tokens"] == o.received for o in done)
    return {"requests": len(done), "prompt_tokens": sum(o.usage["prompt_tokens"] for o in done if o.usage),
            "completion_tokens": sum(o.received for o in done)}


def test_concurrent_streams_cut_by_an_ingress_restart_count_once_what_clients_received(
    metered: Metered,
) -> None:
    """Streams of both tenants run when the ingress dies. Each cut stream counts once, folded by the
    new ingress's sweeper from its open entry: its prompt, and its completion tokens within the
    documented lag of what its client received (`usage_open`), never more. Streams after the
    restart count exactly."""
    import ray

    wait_until(lambda: metered.health()["usage_pending"] == 0, 30, "earlier usage written")
    before = {t: metered.totals(t) for t in TENANTS}
    cut = [CountedStream(t) for t in TENANTS for _ in range(2)]
    threads = _streams(metered, cut, LONG_RUN)
    wait_until(lambda: all(o.received >= 2 for o in cut), 60, "every stream under way", poll_s=0.2)
    named = next(a for a in ray.util.list_named_actors(all_namespaces=True) if "#Ingress#" in a["name"])
    ray.kill(ray.get_actor(named["name"], namespace=named["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=90)
    assert all(o.ended in ("broken", "error") for o in cut), [(o.ended, o.received) for o in cut]

    wait_until(metered.admin_answers, 120, "a new ingress replica", poll_s=0.5)
    # The sweeper folds an entry once its heartbeat is `STALE_AFTER_S` old, within a sweep interval.
    wait_until(lambda: all(metered.totals(t)["requests"] >= before[t]["requests"] + 2 for t in TENANTS),
               STALE_AFTER_S + 4 * SWEEP_EVERY_S, "the cut streams swept", poll_s=0.5)
    folded = {t: added(before[t], metered.totals(t)) for t in TENANTS}
    restarted = {t: metered.totals(t) for t in TENANTS}

    after = [CountedStream(t) for t in TENANTS for _ in range(2)]
    for t in _streams(metered, after, {**LONG_RUN, "max_tokens": 12}):
        t.join(timeout=90)
    grew_after = {}
    for tenant in TENANTS:
        expected = _completed(after, tenant)
        assert expected["requests"] == 2, [(o.ended, o.received) for o in after]
        grew = grew_after[tenant] = wait_for_usage(metered, tenant, restarted[tenant], 2)
        assert {k: grew[k] for k in expected} == expected, (tenant, grew, expected)
        mine = [o for o in cut if o.tenant == tenant]
        received = sum(o.received for o in mine)
        bound = sum(o.lag_bound for o in mine)
        prompt = expected["prompt_tokens"] // 2  # the same prompt as the cut streams
        got = folded[tenant]
        print(f"\n{tenant}: cut streams received {received} completion tokens, "
              f"{got['completion_tokens']} recorded (bound {bound})")
        assert got["requests"] == 2 and got["prompt_tokens"] == 2 * prompt, (tenant, got, prompt)
        assert received - bound <= got["completion_tokens"] <= received, (tenant, got, received, bound)
    for tenant in TENANTS:  # nothing folded or closed twice since
        assert metered.totals(tenant) == {k: restarted[tenant][k] + grew_after[tenant][k] for k in COUNTS}
