"""Reasoning split off V4's answers: complete and streaming (any piece size) agree, markers never
reach the content, and a model that misplaces them cannot break the split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from antumbra.replicas.chat.output import ChatOutputParser, parse_chat_output
from antumbra.replicas.chat.reasoning import ReasoningStreamParser, ReasoningTokenCounter, split_reasoning

# (text, thinking) -> (reasoning, content)
CASES = {
    "thought then answer": ("Let me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
    "empty thought": ("</think>Hi", True, ("", "Hi")),
    "cut while thinking": ("still going", True, ("still going", "")),
    "a second thought": ("a</think>b<think>c</think>d", True, ("ac", "bd")),
    "stray opener inside the thought": ("a<think>b</think>c", True, ("ab", "c")),
    "non-thinking": ("Plain answer.", False, (None, "Plain answer.")),
    "non-thinking drops stray markers": ("x</think>y<think>z", False, (None, "xyz")),
    "marker-like text that is not one": ("a </thin k> <thinking>", False, (None, "a </thin k> <thinking>")),
}


def _stream(text: str, thinking: bool, step: int) -> tuple[str, str]:
    parser, reasoning, content = ReasoningStreamParser(thinking), "", ""
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content


@pytest.mark.parametrize("name", list(CASES))
def test_complete_and_streaming_split_agree(name: str) -> None:
    text, thinking, expected = CASES[name]
    assert split_reasoning(text, thinking) == expected
    for step in (1, 2, 5):
        reasoning, content = _stream(text, thinking, step)
        assert ((reasoning if thinking else None), content) == expected


def test_a_partial_marker_is_held_until_decided() -> None:
    parser = ReasoningStreamParser(thinking=True)
    assert (parser.feed("abc</th").reasoning, parser.feed("ink>").content) == ("abc", "")
    assert parser.feed("ans</").content == "ans"
    assert parser.feed("b>").content == "</b>"


def test_reasoning_and_tool_calls_together() -> None:
    call = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    out = parse_chat_output("why</think>ok" + call, thinking=True, tool_names=["f"])
    assert (out.reasoning, out.content, [c.name for c in out.calls]) == ("why", "ok", ["f"])
    # DSML inside the thought is reasoning text, not a call.
    inside = parse_chat_output(call + "</think>done", thinking=True, tool_names=["f"])
    assert (inside.reasoning, inside.content, inside.calls) == (call, "done", ())


PIECES = [
    "<think>",
    "</think>",
    "\n\n",
    "\n",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    '<｜DSML｜parameter name="b" string="false">',
    "</｜DSML｜parameter>",
    "<",
    "｜DSML｜",
    "1",
    "x",
    '"',
    ">",
    " ",
    "{",
    "}",
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=40),
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
    st.booleans(),
)
def test_random_markup_never_raises_and_streams_like_the_whole(
    pieces: list[str], steps: list[int], thinking: bool
) -> None:
    """What a random model emits: any mix of markers, cut anywhere."""
    text = "".join(pieces)
    whole = parse_chat_output(text, thinking=thinking, tool_names=["f"])
    parser, reasoning, content, calls, at = (
        ChatOutputParser(thinking=thinking, tool_names=["f"]),
        "",
        "",
        [],
        0,
    )
    for i in range(len(text)):
        if at >= len(text):
            break
        size = steps[i % len(steps)]
        out = parser.feed(text[at : at + size])
        at += size
        reasoning, content, calls = reasoning + out.reasoning, content + out.content, calls + out.calls
    out = parser.finish()
    assert (
        reasoning + out.reasoning if thinking else None,
        content + out.content,
        tuple(calls + out.calls),
    ) == (whole.reasoning, whole.content, whole.calls)
    assert "<think>" not in whole.content and "</think>" not in whole.content
    assert all(c.name == "f" and isinstance(json.loads(c.arguments), dict) for c in whole.calls)


@pytest.mark.parametrize(("tokens", "thinking", "count"), [
    (["Let", " me", " see", "</think>", "It", " is"], True, 3),  # V4's end marker: one token, not counted
    (["a", "</", "think", ">", "b"], True, 3),  # spelled out: only the token completing it is left out
    (["a", "</think>", "b", "<think>", "c", "d", "</think>"], True, 3),  # a second thought counts too
    (["still", " going"], True, 2),  # cut while thinking: all of it
    (["x", "</think>", "y"], False, 0),  # no thinking, no reasoning
])
def test_reasoning_tokens_are_counted_one_token_at_a_time(
    tokens: list[str], thinking: bool, count: int
) -> None:
    counter = ReasoningTokenCounter(thinking)
    for token in tokens:
        counter.add(token)
    assert counter.count == count
