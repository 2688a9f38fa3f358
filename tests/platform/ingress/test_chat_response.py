"""Chat answers with reasoning and DSML tool calls, as chunks and as one body, read by the official
`openai` client's own types and stream accumulator (the REST round trips are in launch/test_app.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from antumbra.platform.ingress.chat_response import argument_fragments
from antumbra.platform.ingress.openai_responses import ResponseBuilder
from antumbra.replicas.chat.dsml import ToolCall, render_tool_calls
from antumbra.replicas.chat.output import ChatOutputParser

CALLS = [
    ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3})),
    ToolCall("now", "{}"),
]
ANSWER = "The user wants weather.</think>Checking." + render_tool_calls(CALLS)


def run(text: str, *, thinking: bool, tools: bool, step: int, reason: str = "stop") -> tuple[list, Any]:
    names = ["get_weather", "now", "f"] if tools else None
    """Feed `text` in pieces of `step` characters; -> (stream chunks, non-streaming body)."""
    builder = ResponseBuilder(
        kind="chat",
        response_id="chatcmpl-1",
        created=1,
        model="m",
        prompt_tokens=3,
        top_logprobs=None,
        decode=str,
        chat_output=lambda: ChatOutputParser(thinking=thinking, tool_names=names),
    )
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    chunks = [builder.role_chunk()]
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        item = {
            "text": piece,
            "token_ids": [0],
            "logprobs": None,
            "finish_reason": reason if last else None,
            "cached_tokens": 0,
            "completion_tokens": n + 1,
        }
        chunks += builder.chunks(item, builder.add(item))
    return chunks, builder.response().model_dump()


def accumulate(chunks: list[dict[str, Any]]) -> Any:
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.current_completion_snapshot  # what the client assembled (also for a cut answer)


@pytest.mark.parametrize("step", [1, 7, len(ANSWER)])
def test_tool_calls_stream_as_openai_does_and_match_the_whole_answer(step: int) -> None:
    chunks, body = run(ANSWER, thinking=True, tools=True, step=step)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content == "Checking."
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("now", {}),
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    # Each call: first its index, id, type and name, then argument fragments appended to it.
    call_deltas = [
        c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]
    ]
    assert call_deltas[0]["id"].startswith("call_") and call_deltas[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert [d["function"]["arguments"] for d in call_deltas[1:3]] == ['{"city": "Paris"', ', "days": 3}']
    streamed = accumulate(chunks).choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == message.content
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.id, c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
    assert reasoning == "The user wants weather."


def test_without_tools_markup_is_plain_content_and_thinking_off_has_no_reasoning() -> None:
    _, body = run("a <think>b</think>" + render_tool_calls(CALLS[:1]), thinking=False, tools=False, step=5)
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and "tool_calls" not in message
    assert message["content"] == "a b" + render_tool_calls(CALLS[:1])  # markers dropped, DSML untouched
    assert body["choices"][0]["finish_reason"] == "stop"


def test_broken_markup_is_content_with_a_warning_never_half_a_call(caplog: pytest.LogCaptureFixture) -> None:
    broken = (
        'x\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">{'
    )
    with caplog.at_level(logging.WARNING):
        chunks, body = run(broken, thinking=False, tools=True, step=3, reason="length")
    assert (
        body["choices"][0]["message"]["content"] == broken
        and "tool_calls" not in body["choices"][0]["message"]
    )
    assert body["choices"][0]["finish_reason"] == "length"
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert accumulate(chunks).choices[0].message.content == broken
    assert "did not parse" in caplog.text


def test_thinking_cut_by_length_is_all_reasoning() -> None:
    chunks, body = run("still thinking", thinking=True, tools=False, step=4, reason="length")
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "still thinking" and message["content"] == ""


def test_argument_fragments_join_to_the_arguments() -> None:
    for args in ('{"a": 1, "b": "é", "c": {"d": [1, 2]}}', "{}", '{"only": null}'):
        pieces = argument_fragments(args)
        assert "".join(pieces) == args and len(pieces) == max(1, len(json.loads(args)))
