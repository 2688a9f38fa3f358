"""Multi-tenant chat load for Antumbra's OpenAI-compatible API.

    ANTUMBRA_LOADTEST_TENANTS="alpha:sk-ant-...:2:3,beta:sk-ant-...:0.5:1" \
        locust -f loadtest/locustfile.py --host http://127.0.0.1:8000

Each user belongs to one tenant (spread by the tenants' weights), sends that tenant's API key,
and runs multi-turn chats on the tenant's shared system prompts at the tenant's per-user rate
(`constant_throughput`). A share of requests streams (`ANTUMBRA_LOADTEST_STREAM_RATIO`). Other
knobs: `ANTUMBRA_LOADTEST_*` in `loadtest/workload.py` (`WorkloadConfig.from_env`).

Statistics, grouped per tenant (`chat [tenant]`, `chat stream [tenant]`):
  * the requests themselves: a stream's response time covers the whole stream, not its headers;
    a 4xx/5xx status, an SSE error event or a stream without `[DONE]` is a failure;
  * custom events: `TTFT` (time to first content chunk) and `ITL` (mean gap between content
    chunks, one sample per stream with two or more chunks), fired with `events.request.fire`;
  * at the end, per-tenant token totals (requests, prompt, cached and completion tokens) and
    the final statistics are written to `ANTUMBRA_LOADTEST_REPORT` (JSON) if set.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, events, task
from locust.user.wait_time import constant_throughput

try:
    from loadtest import workload as wl
except ImportError:  # run by path from another directory: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from loadtest import workload as wl

CONFIG = wl.WorkloadConfig.from_env()
ASSIGNER = wl.TenantAssigner(CONFIG.tenants)
TOTALS: dict[str, wl.TenantTotals] = {t.name: wl.TenantTotals() for t in CONFIG.tenants}
_user_ids = itertools.count()
_model: str | None = CONFIG.model


def _fire(request_type: str, name: str, seconds: float) -> None:
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=seconds * 1000.0,
        response_length=0,
        exception=None,
        context={},
    )


class TenantChatUser(HttpUser):
    """One chat user of one tenant; see the module docstring."""

    def on_start(self) -> None:
        self.tenant = ASSIGNER.next()
        self.user_index = next(_user_ids)
        self._throughput = constant_throughput(self.tenant.rps)
        rng = random.Random(f"{CONFIG.seed}:{self.tenant.name}:{self.user_index}")
        self.rng = rng
        prompts = wl.system_prompts(self.tenant.name, CONFIG.system_prompts, CONFIG.system_words, CONFIG.seed)
        message_words = self.tenant.message_words or CONFIG.message_words
        self.conversation = wl.Conversation(prompts, CONFIG.turns, message_words, rng)
        self.headers = {"Authorization": f"Bearer {self.tenant.api_key}"}
        self.model = self._discover_model()

    def wait_time(self) -> float:
        return self._throughput(self)

    def _discover_model(self) -> str:
        global _model
        if _model is None:
            with self.client.get(
                "/v1/models", headers=self.headers, name="models", catch_response=True
            ) as resp:
                if resp.status_code == 200 and resp.json().get("data"):
                    _model = resp.json()["data"][0]["id"]
                else:
                    resp.failure(f"cannot list models: HTTP {resp.status_code}")
                    return "unknown"
        return _model

    @task
    def chat(self) -> None:
        messages = self.conversation.next_messages()
        if self.rng.random() < CONFIG.stream_ratio:
            self._stream(messages)
        else:
            self._plain(messages)

    def _plain(self, messages: list[dict[str, str]]) -> None:
        body = wl.chat_body(self.model, messages, CONFIG, stream=False, max_tokens=self.tenant.max_tokens)
        name = f"chat [{self.tenant.name}]"
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.headers,
            name=name,
            catch_response=True,
            timeout=CONFIG.request_timeout_s,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                self.conversation.answer("")
                return
            try:
                payload: dict[str, Any] = resp.json()
                text = payload["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                resp.failure(f"bad completion body: {exc!r}")
                self.conversation.answer("")
                return
            TOTALS[self.tenant.name].add(payload.get("usage"))
            self.conversation.answer(text)
            resp.success()

    def _stream(self, messages: list[dict[str, str]]) -> None:
        body = wl.chat_body(self.model, messages, CONFIG, stream=True, max_tokens=self.tenant.max_tokens)
        name = f"chat stream [{self.tenant.name}]"
        start = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.headers,
            name=name,
            stream=True,
            catch_response=True,
            timeout=CONFIG.request_timeout_s,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                self.conversation.answer("")
                return
            try:
                result = wl.read_sse(resp.iter_lines(), start)
            except Exception as exc:  # a connection that breaks mid-stream
                result = wl.StreamResult(error=f"stream broke: {exc!r}")
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000.0
            resp.request_meta["response_length"] = result.num_bytes
            if result.error is not None:
                resp.failure(result.error)
                self.conversation.answer("")
                return
            resp.success()
        TOTALS[self.tenant.name].add(result.usage)
        self.conversation.answer(result.text)
        if result.ttft_s is not None:
            _fire("TTFT", name, result.ttft_s)
        gaps = result.itl_s
        if gaps:
            _fire("ITL", name, sum(gaps) / len(gaps))


def _final_stats(environment: Any) -> list[dict[str, Any]]:
    """Every statistics entry once the run is over (the periodic CSV can miss the last requests)."""
    runner = getattr(environment, "runner", None)
    if runner is None:
        return []
    rows = []
    for entry in runner.stats.entries.values():
        count = entry.num_requests
        rows.append(
            {
                "type": entry.method,
                "name": entry.name,
                "count": count,
                "failures": entry.num_failures,
                "mean_ms": entry.avg_response_time if count else None,
                "p50_ms": entry.get_response_time_percentile(0.5) if count else None,
                "p90_ms": entry.get_response_time_percentile(0.9) if count else None,
                "p99_ms": entry.get_response_time_percentile(0.99) if count else None,
                "max_ms": entry.max_response_time if count else None,
                "rps": entry.total_rps,
            }
        )
    return rows


@events.quitting.add_listener
def _write_report(environment: Any, **_: Any) -> None:
    """Per-tenant token totals and the final statistics, as JSON at `ANTUMBRA_LOADTEST_REPORT`."""
    if not CONFIG.report_path:
        return
    report = {
        "tenants": {name: vars(totals) for name, totals in TOTALS.items()},
        "stats": _final_stats(environment),
    }
    Path(CONFIG.report_path).write_text(json.dumps(report, indent=2) + "\n")
