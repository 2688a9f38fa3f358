"""Fuzz the running app from its own OpenAPI schema: no input may produce a 5xx or a non-OpenAI error.

Positive examples (valid by the schema) and negative ones (violating it) for every operation,
with a bounded number of examples; generation lengths are capped so a fuzzed `max_tokens`
cannot turn a case into a minute of CPU decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from antumbra.platform.launch.redis_server import free_port  # noqa: E402
from antumbra.platform.launch.serve_cli import RunningPlatform, local_platform  # noqa: E402

MODEL = "tiny"
MAX_GENERATED = 4
MAX_CHOICES = 2  # a fuzzed `n` of 128 would decode 128 sequences for one case
EXAMPLES = {"positive": 25, "negative": 10}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def running(tiny_checkpoint: Path) -> Iterator[tuple[RunningPlatform, str]]:
    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "max_model_len": 512}}}
    with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as platform:
        created = httpx.post(
            f"{platform.base_url}/admin/tenants",
            json={"id": "fuzz"},
            headers={"Authorization": f"Bearer {platform.admin_key}"},
        )
        assert created.status_code == 201, created.text
        yield platform, created.json()["api_key"]


def _adjust(case: Any, positive: bool) -> None:
    """Name the served model in valid bodies (else nearly every case stops at 404), and keep
    generation short: fuzzed lengths are about validation, not about decoding speed."""
    body = case.body
    if case.path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    if positive:
        body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GENERATED:
            body[name] = MAX_GENERATED
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_GENERATED
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > MAX_GENERATED:
        body["min_tokens"] = MAX_GENERATED
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES


def _fuzz(operation: Any, mode: Any, base_url: str, headers: dict[str, str], failures: list[str]) -> int:
    """Run one operation's examples of one generation mode; returns how many requests were sent."""
    calls = 0
    positive = mode is schemathesis.GenerationMode.POSITIVE

    @settings(
        max_examples=EXAMPLES[mode.value],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        nonlocal calls
        _adjust(case, positive)
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        calls += 1
        where = f"{case.method} {case.formatted_path} ({mode.value}) body={str(case.body)[:200]!r}"
        if response.status_code >= 500:
            failures.append(f"{response.status_code} for {where}: {response.text[:300]}")
        elif response.status_code >= 400:
            body = _json(response)
            if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
                failures.append(f"{response.status_code} without an OpenAI error for {where}: {body!r}")

    with contextlib.suppress(Unsatisfiable):  # nothing to negate (an operation without parameters or body)
        check()
    return calls


def test_fuzz_openapi_schema_finds_no_5xx(running: tuple[RunningPlatform, str]) -> None:
    platform, api_key = running
    schema = schemathesis.openapi.from_url(f"{platform.base_url}/openapi.json")
    tenant_auth = {"Authorization": f"Bearer {api_key}"}
    admin_auth = {"Authorization": f"Bearer {platform.admin_key}"}
    failures: list[str] = []
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        headers = admin_auth if operation.path.startswith("/admin") else tenant_auth
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            calls += _fuzz(operation, mode, platform.base_url, headers, failures)

    assert calls > 50
    assert not failures, "\n".join(failures[:20])
    # The server still answers normally after the fuzzing.
    ok = httpx.post(
        f"{platform.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "ok", "max_tokens": 1},
        headers=tenant_auth,
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
