"""A speculating model served by the platform: real Ray Serve, a real redis-server and the tiny model
(its MTP block drafting 3 tokens a step), through the official openai client.

One app serves the same checkpoint twice, plain and speculating: greedy answers are the same text, and
the speculating model's answers carry its draft counts in the response's `antumbra` object, streaming
or not; the platform's per-tenant metrics count them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from antumbra.platform.launch.platform_config import PlatformConfig
from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import RunningPlatform, config_from_args, local_platform
from antumbra.platform.metrics import observe_request
from tests.openai_clients import platform_client as client

PLAIN, SPEC = "tiny", "tiny-spec"
DRAFTS = 3
PROMPT = "Speculate about the weather in the mountains: "


@pytest.fixture(scope="module")
def platform(tiny_checkpoint: Path) -> Iterator[RunningPlatform]:
    models = {PLAIN: {"path": str(tiny_checkpoint), "max_model_len": 2048},
              SPEC: {"path": str(tiny_checkpoint), "max_model_len": 2048, "speculative_tokens": DRAFTS}}
    with local_platform({"models": models}, port=free_port(), num_cpus=2) as running:
        assert running.api_key is not None
        yield running


def test_completions_are_the_plain_models_text_with_the_draft_counts(platform: RunningPlatform) -> None:
    answers = {
        model: client(platform).completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0,
                                                    extra_body={"ignore_eos": True})
        for model in (PLAIN, SPEC)
    }
    assert answers[SPEC].choices[0].text == answers[PLAIN].choices[0].text
    assert answers[SPEC].usage is not None and answers[SPEC].usage.completion_tokens == 32
    counts = (answers[SPEC].model_extra or {})["antumbra"]["speculation"]
    assert counts["drafted_tokens"] > 0
    assert 0 <= counts["accepted_tokens"] <= counts["drafted_tokens"]
    assert (answers[PLAIN].model_extra or {})["antumbra"]["speculation"] is None


def test_a_stream_carries_the_counts_on_its_last_chunk(platform: RunningPlatform) -> None:
    messages = [{"role": "user", "content": "Count the colours of a rainbow."}]
    texts, last = {}, None
    for model in (PLAIN, SPEC):
        stream = client(platform).chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "thinking": {"type": "disabled"}},
        )
        chunks = list(stream)
        texts[model] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        if model == SPEC:
            last = next(c for c in reversed(chunks) if (c.model_extra or {}).get("antumbra"))
    assert texts[SPEC] == texts[PLAIN]
    assert last is not None
    assert last.model_extra["antumbra"]["speculation"]["drafted_tokens"] > 0


def test_the_serve_flag_and_the_model_spec_turn_it_on(tiny_checkpoint: Path) -> None:
    from antumbra.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), "--speculative-tokens", "2",
                                      "--speculative-token-map", "ids.json", "--speculative-max-batch", "8"])
    data = config_from_args(args)
    spec = next(iter(data["models"].values()))
    assert spec["speculative_tokens"] == 2 and spec["speculative_token_map"] == "ids.json"
    config = PlatformConfig.from_dict({"redis_url": "redis://127.0.0.1:1/0", **data})
    kwargs = config.models[0].engine_kwargs()
    assert kwargs["speculative_tokens"] == 2 and kwargs["speculative_token_map"] == "ids.json"
    assert kwargs["speculative_max_batch"] == 8
    # Unset, the engine's default cap: the threshold the GPU benchmark measured.
    unset = config_from_args(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint),
                                                        "--speculative-tokens", "2"]))
    assert "speculative_max_batch" not in next(iter(unset["models"].values()))


def test_metrics_count_drafted_and_accepted_tokens_per_tenant() -> None:
    from antumbra.platform.ingress.observation import RequestRecord
    from antumbra.platform.metrics import default_metrics

    metrics = default_metrics()
    before = [metrics.count(name, "alpha", SPEC) for name in ("spec_drafted_tokens", "spec_accepted_tokens")]
    record = RequestRecord(tenant_id="alpha", model=SPEC, endpoint="completions", status=200, stream=False,
                           completion_tokens=20, drafted_tokens=27, accepted_tokens=11)
    observe_request(record)
    assert metrics.count("spec_drafted_tokens", "alpha", SPEC) - before[0] == 27
    assert metrics.count("spec_accepted_tokens", "alpha", SPEC) - before[1] == 11
