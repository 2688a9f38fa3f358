"""DSML tool-call markup: rendering as V4 writes it, and the complete and streaming parsers agreeing."""

from __future__ import annotations

import json
import logging

import pytest

from antumbra.replicas.chat.dsml import (
    DsmlParse,
    DsmlStreamParser,
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
)

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3, "units": {"t": "C"}}))
NO_ARGS = ToolCall("now", "{}")

# Written out by hand from V4's rules (blank line before the block, newline-separated elements,
# raw strings with string="true", JSON otherwise, an empty line for an invoke without arguments).
EXPECTED_BLOCK = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="units" string="false">{"t": "C"}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n'
    "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def _stream(text: str, step: int) -> tuple[str, list[ToolCall]]:
    parser, content, calls = DsmlStreamParser(), "", []
    for i in range(0, len(text), step):
        out = parser.feed(text[i : i + step])
        content, calls = content + out.content, calls + out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


def test_render_writes_v4_markup() -> None:
    assert render_tool_calls([WEATHER, NO_ARGS]) == EXPECTED_BLOCK


def test_raw_string_values_round_trip() -> None:
    call = ToolCall("echo", json.dumps({"text": 'a "quoted" <b>\nline', "n": None, "ok": True}))
    parsed = parse_tool_calls(render_tool_calls([call]))
    assert parsed.content == ""
    assert [json.loads(c.arguments) for c in parsed.calls] == [json.loads(call.arguments)]


CASES = {
    "content and two calls": ("Let me check." + EXPECTED_BLOCK, "Let me check.", [WEATHER, NO_ARGS]),
    "calls only": (EXPECTED_BLOCK.lstrip("\n"), "", [WEATHER, NO_ARGS]),
    "no markup": ("plain answer\n\nwith a blank line ", "plain answer\n\nwith a blank line ", []),
    "text after the block": (EXPECTED_BLOCK + "\nafter", "after", [WEATHER, NO_ARGS]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("step", [None, 1, 3])
def test_complete_and_streaming_agree(name: str, step: int | None) -> None:
    text, content, calls = CASES[name]
    if step is None:
        parsed = parse_tool_calls(text)
        got_content, got_calls = parsed.content, list(parsed.calls)
    else:
        got_content, got_calls = _stream(text, step)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def test_stream_releases_content_before_the_block_is_decided() -> None:
    parser = DsmlStreamParser()
    assert parser.feed("Hello").content == "Hello"
    assert parser.feed(" world\n\n<").content == " world"  # the blank line and "<" may open a block
    assert parser.feed("b>").content == "\n\n<b>"


_F = '<｜DSML｜invoke name="f">\n'
BROKEN = {
    "bad JSON": _F + '<｜DSML｜parameter name="a" string="false">{x</｜DSML｜parameter>\n',
    "unclosed invoke": _F + '<｜DSML｜parameter name="a" string="true">v',
    "bad string flag": _F + '<｜DSML｜parameter name="a" string="maybe">v</｜DSML｜parameter>',
    "junk in block": "hello there",
    "duplicate parameter": (
        _F + '<｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter>\n</｜DSML｜invoke>'
    ),
    "NaN value": _F + '<｜DSML｜parameter name="a" string="false">NaN</｜DSML｜parameter>\n</｜DSML｜invoke>',
}


@pytest.mark.parametrize("name", list(BROKEN))
@pytest.mark.parametrize("step", [None, 1])
def test_broken_markup_is_content_with_a_warning(
    name: str, step: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    text = "Answer:\n\n<｜DSML｜tool_calls>\n" + BROKEN[name]
    with caplog.at_level(logging.WARNING, logger="antumbra.replicas.chat.dsml"):
        if step is None:
            parsed = parse_tool_calls(text)
            content, calls = parsed.content, list(parsed.calls)
        else:
            content, calls = _stream(text, step)
    assert calls == []
    assert content == text
    assert any("did not parse" in r.getMessage() for r in caplog.records)


def test_a_break_after_complete_calls_keeps_them_and_returns_the_rest() -> None:
    good = render_tool_calls([WEATHER]).removesuffix("\n</｜DSML｜tool_calls>")
    text = good + "\n<｜DSML｜invoke oops"
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == "\n<｜DSML｜invoke oops"  # the unparsed text as it came
    assert _stream(text, 1) == (parsed.content, list(parsed.calls))


def test_a_call_of_a_tool_not_offered_is_content() -> None:
    text = "Hi" + EXPECTED_BLOCK
    parsed = parse_tool_calls(text, tool_names=["get_weather"])
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == "Hi\n" + EXPECTED_BLOCK.split("</｜DSML｜invoke>\n", 1)[1]
    assert parse_tool_calls(text, tool_names=["other"]) == DsmlParse(text, ())


@pytest.mark.parametrize("step", [None, 1, 7])
def test_one_call_at_most_drops_the_others_with_a_warning(
    step: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """`parallel_tool_calls: false` without a grammar: the first call is kept, the others dropped
    and logged, and the content is the text around the block, no markup of the dropped calls."""
    from antumbra.replicas.chat.output import ChatOutputParser

    text = "Let me check." + EXPECTED_BLOCK + "\nafter"
    parser = ChatOutputParser(thinking=False, tool_names=["get_weather", "now"], max_calls=1)
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    with caplog.at_level(logging.WARNING, logger="antumbra.replicas.chat.output"):
        steps = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(s.content for s in steps)
    calls = [c for s in steps for c in s.calls]
    assert content == "Let me check.after"
    assert [(c.name, c.arguments) for c in calls] == [(WEATHER.name, WEATHER.arguments)]
    assert "parallel tool calls are off" in caplog.text and "now" in caplog.text
    unlimited = ChatOutputParser(thinking=False, tool_names=["get_weather", "now"])
    assert len(unlimited.feed(text).calls + unlimited.finish().calls) == 2
