"""Structured output through the platform: the official `openai` client against real Ray Serve,
a real redis-server and the tiny random model with the real DeepSeek-V4 tokenizer.

A random model follows no instruction, so whatever it answers under `response_format` or a forced
tool call is the grammar's doing. Schemas bound their strings and numbers so that every answer
completes within `max_tokens` (`finish_reason` "stop" is asserted, then the answer parsed and
validated with `jsonschema`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import local_platform

MODEL = "tiny"
NO_THINKING = {"thinking": {"type": "disabled"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def client(tiny_checkpoint: Path) -> Iterator[openai.OpenAI]:
    config = {"models": {MODEL: {"path": str(tiny_checkpoint), "max_model_len": 1024}}}
    with local_platform(config, port=free_port(), num_cpus=2) as running:
        assert running.api_key is not None
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=running.api_key, max_retries=0,
                            timeout=120)


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_answers_parse_and_validate_for_20_seeds(client: openai.OpenAI) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=seed,
            response_format=_schema_format(PERSON), extra_body=NO_THINKING,  # type: ignore[arg-type]
        )

    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(ask, range(20)))
    texts = set()
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 1  # the seeds draw different answers, all of them valid


def test_json_object_answer_parses_streaming_and_not(client: openai.OpenAI) -> None:
    # Any JSON object has unbounded strings, which a random model rarely closes: this prompt is one
    # whose greedy answer under the grammar is short on the tiny model.
    messages = [{"role": "user", "content": "Return an empty object"}]
    kwargs: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.0,
                                  response_format={"type": "json_object"}, extra_body=NO_THINKING)
    answer = client.chat.completions.create(**kwargs)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**kwargs, stream=True) if chunk.choices)
    assert streamed == answer.choices[0].message.content


def test_completions_take_response_format_too(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="A person:", max_tokens=40, temperature=0.7,
                                       seed=1, extra_body={"response_format": _schema_format(PERSON)})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)


@pytest.mark.parametrize("schema, param", [
    ({"type": "object", "properties": {"age": {"type": "integr"}}}, "response_format.json_schema.schema"),
    ({"type": "object", "required": "age"}, "response_format.json_schema.schema"),
    ({"type": "string", "format": "no-such-format"}, "response_format.json_schema.schema"),
])
def test_a_schema_that_cannot_constrain_is_a_400_and_the_server_still_answers(
    client: openai.OpenAI, schema: Any, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format=_schema_format(schema))  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error"
    fine = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert fine.choices[0].finish_reason == "length"


def test_json_schema_without_its_schema_object_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "json_schema"})  # type: ignore[typeddict-item]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "response_format.json_schema"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"enum": ["news", "maps"]},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["q"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in allowed
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice_returns_a_valid_call(client: openai.OpenAI, seed: int) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed, extra_body=NO_THINKING,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id and calls[0].type == "function"
    _check_calls([{"name": c.function.name, "arguments": c.function.arguments} for c in calls], set(SCHEMAS))
    assert "DSML" not in (choice.message.content or "") and "<" not in (choice.message.content or "")


def test_required_tool_choice_streams_the_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=160, temperature=1.0, seed=3, stream=True, extra_body=NO_THINKING,
    )
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            if part.function is not None:
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    _check_calls([calls[i] for i in sorted(calls)], set(SCHEMAS))
    assert "DSML" not in content and "<" not in content


# "<" and V4's DSML token made near certain wherever the grammar allows them: after a call's closing
# tag the only choice is another call ("<" DSML "invoke") or the block's end ("</"), so a grammar
# that allowed a second call would have this model write calls until max_tokens.
ANOTHER_CALL_BIAS = {"30": 100, "128825": 100}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_allows_exactly_one_call(
    client: openai.OpenAI, tool_choice: Any, stream: bool
) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
        temperature=1.0, seed=5, logit_bias=ANOTHER_CALL_BIAS, extra_body=NO_THINKING,
    )
    calls, content, finish = _tool_answer(client, {**kwargs, "parallel_tool_calls": False}, stream)
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls, content)
    _check_calls(calls, set(SCHEMAS))
    assert "DSML" not in content and "<" not in content
    if tool_choice == "required":  # the same bias with parallel calls allowed: call after call
        many, _, finish = _tool_answer(client, kwargs, stream)
        assert finish == "length" and len(many) > 1


def _tool_answer(client: openai.OpenAI, kwargs: dict[str, Any], stream: bool) -> tuple[list[Any], str, Any]:
    """(the calls as {name, arguments}, the content, the finish reason), streamed or whole."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return calls, choice.message.content or "", choice.finish_reason
    parts: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = parts.setdefault(part.index, {"name": "", "arguments": ""})
            if part.function is not None:
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [parts[i] for i in sorted(parts)], content, finish


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, max_tokens=80, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "search"}}, extra_body=NO_THINKING,
    )
    calls = answer.choices[0].message.tool_calls or []
    assert answer.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    _check_calls([{"name": c.function.name, "arguments": c.function.arguments} for c in calls], {"search"})


def test_an_unknown_tool_name_or_a_bad_tool_schema_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tool_choice"
    not_a_schema = {"type": "object", "properties": {"a": {"type": 7}}}
    broken: Any = [{"type": "function", "function": {"name": "f", "parameters": not_a_schema}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=broken,
                                       tool_choice="required", max_tokens=8)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools"


THINKING = {"thinking": {"type": "enabled"}}
# `</think>` (V4's token 128822) likelier than the rest of the vocabulary together (e^13 against
# 129,280 rows), so the random model closes its reasoning within a few tokens: the reasoning is free
# text, only the answer after it is constrained.
END_THINKING_SOON = {"128822": 13}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thinking_reasons_freely_then_answers_under_the_schema(client: openai.OpenAI, seed: int) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed, extra_body=THINKING,
        response_format=_schema_format(PERSON), logit_bias=END_THINKING_SOON,  # type: ignore[arg-type]
    )
    choice = answer.choices[0]
    reasoning = (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.finish_reason == "stop" and isinstance(reasoning, str)
    assert "</think>" not in reasoning and "<think>" not in (choice.message.content or "")
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_thinking_then_a_required_tool_call(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        max_tokens=200, temperature=1.0, seed=4, extra_body=THINKING, logit_bias=END_THINKING_SOON,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert isinstance((choice.message.model_extra or {}).get("reasoning_content"), str)
    _check_calls([{"name": c.function.name, "arguments": c.function.arguments}
                  for c in choice.message.tool_calls or []], set(SCHEMAS))
    assert "DSML" not in (choice.message.content or "")
