"""DeepSeek-V4's DSML tool-call markup: its constants, rendering calls to it, and parsing it back.

The layout, as DeepSeek-V4's release encodes an assistant turn that calls tools (the
`encoding_dsv4` module shipped beside the weights; `｜DSML｜` is one added token of the V4
`tokenizer.json`, id 128825, so each tag below is `<` + that token + a name)::

    {content}\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

Rules: the block follows the turn's content after a blank line (also when the content is
empty); invokes, and the parameters inside an invoke, are separated by single newlines; an
invoke without arguments keeps an empty line between its two tags. A parameter whose value is
a JSON string is written raw (unescaped) with `string="true"`; every other value (number,
boolean, null, array, object) is written as JSON with `string="false"`.

API (kept small; the structured-output code builds its grammar on these constants):

- `ToolCall(name, arguments)`: one call; `arguments` is the JSON text of an object.
- `render_tool_calls(calls)`: the text appended after an assistant turn's content.
- `parse_tool_calls(text, tool_names)`: a whole completion's text to content + calls (never raises).
- `DsmlStreamParser(tool_names)`: the same parse fed incrementally; `feed(delta)` / `finish()` each return
  a `DsmlDelta` of released content and completed calls. A call is released only once its
  invoke has closed and parsed, so a client never sees half a call. Markup that does not parse
  is released as content, with a warning in the log. With `tool_names`, an invoke of any other
  name is such markup too.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DSML_TOKEN = "｜DSML｜"
TOOL_CALLS_PREFIX = "\n\n"  # between the turn's content and the block
TOOL_CALLS_START = f"<{DSML_TOKEN}tool_calls>"
TOOL_CALLS_END = f"</{DSML_TOKEN}tool_calls>"
INVOKE_START = f"<{DSML_TOKEN}invoke"  # followed by ` name="NAME">`
INVOKE_END = f"</{DSML_TOKEN}invoke>"
PARAMETER_START = f"<{DSML_TOKEN}parameter"  # followed by ` name="KEY" string="true|false">`
PARAMETER_END = f"</{DSML_TOKEN}parameter>"

_INVOKE_HEADER = re.compile(r' name="([^"\n]+)">')
_PARAMETER_HEADER = re.compile(r' name="([^"\n]+)" string="(true|false)">')


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the function's name and its arguments as the JSON text of an object."""

    name: str
    arguments: str


def _parameter(key: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else json.dumps(value, ensure_ascii=False)
    flag = "true" if is_string else "false"
    return f'{PARAMETER_START} name="{key}" string="{flag}">{text}{PARAMETER_END}'


def render_invoke(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One `invoke` element; `arguments` is a mapping or the JSON text of an object."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(args, Mapping):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(args).__name__}")
    body = "\n".join(_parameter(str(k), v) for k, v in args.items())
    return f'{INVOKE_START} name="{name}">\n{body}\n{INVOKE_END}'


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """The DSML block as it follows an assistant turn's content, `TOOL_CALLS_PREFIX` included."""
    invokes = "\n".join(render_invoke(c.name, c.arguments) for c in calls)
    return f"{TOOL_CALLS_PREFIX}{TOOL_CALLS_START}\n{invokes}\n{TOOL_CALLS_END}"


@dataclass
class DsmlDelta:
    """What one `feed` / `finish` released: content text and completed calls, in that order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class DsmlParse:
    """A whole completion parsed: content without the markup, and the calls it made."""

    content: str
    calls: tuple[ToolCall, ...]


class _NeedMore(Exception):
    """The buffer ends inside an element: wait for more text."""


class _Broken(Exception):
    """The markup cannot be parsed."""


def _held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _expect(buf: str, pos: int, literal: str) -> int:
    """Position after `literal` at `pos`; `_NeedMore` if the buffer ends inside it."""
    if buf.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(buf[pos:]):
        raise _NeedMore
    raise _Broken(f"expected {literal!r} at {buf[pos:pos + 40]!r}")


def _skip_space(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    return pos


def _header(buf: str, pos: int, pattern: re.Pattern[str]) -> tuple[re.Match[str], int]:
    close = buf.find(">", pos)
    if close < 0:
        if "\n" in buf[pos:]:
            raise _Broken("tag not closed on its line")
        raise _NeedMore
    match = pattern.fullmatch(buf, pos, close + 1)
    if match is None:
        raise _Broken(f"malformed tag {buf[pos:close + 1]!r}")
    return match, close + 1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parameter_value(buf: str, pos: int, key: str, is_string: bool) -> tuple[Any, int]:
    end = buf.find(PARAMETER_END, pos)
    if end < 0:
        raise _NeedMore
    raw = buf[pos:end]
    if is_string:
        return raw, end + len(PARAMETER_END)
    try:
        return json.loads(raw, parse_constant=_reject_constant), end + len(PARAMETER_END)
    except ValueError:
        raise _Broken(f"parameter {key!r} is not JSON: {raw[:40]!r}") from None


def _invoke(buf: str, pos: int, names: Collection[str] | None) -> tuple[ToolCall, int]:
    """Parse one `invoke` element starting at `pos`; `names`: the tools it may call (None: any)."""
    pos = _expect(buf, pos, INVOKE_START)
    match, pos = _header(buf, pos, _INVOKE_HEADER)
    if names is not None and match.group(1) not in names:
        raise _Broken(f"no tool named {match.group(1)!r} was offered")
    arguments: dict[str, Any] = {}
    while True:
        pos = _skip_space(buf, pos)
        rest = buf[pos:]
        if rest.startswith(INVOKE_END):
            args = json.dumps(arguments, ensure_ascii=False)
            return ToolCall(match.group(1), args), pos + len(INVOKE_END)
        if not rest.startswith(PARAMETER_START):
            if INVOKE_END.startswith(rest) or PARAMETER_START.startswith(rest):
                raise _NeedMore
            raise _Broken(f"expected a parameter or {INVOKE_END!r} at {rest[:40]!r}")
        param, pos = _header(buf, pos + len(PARAMETER_START), _PARAMETER_HEADER)
        key = param.group(1)
        if key in arguments:
            raise _Broken(f"duplicate parameter {key!r}")
        arguments[key], pos = _parameter_value(buf, pos, key, param.group(2) == "true")


class DsmlStreamParser:
    """Splits generated text into content and DSML tool calls as it arrives.

    Content streams through at once, except a tail that may be the start of a block (the
    separating whitespace and a partial `<｜DSML｜tool_calls>`), which is held until decided.
    Inside a block each invoke is released when it has closed and parsed. Once markup fails to
    parse, the unparsed text from that point on, and everything after it, is content.
    """

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        self._names = None if tool_names is None else frozenset(tool_names)
        self._buf = ""
        self._in_block = False
        self._broken = False
        self._block_start = ""  # text of the block not yet released, for a broken block's content
        self._after_block = False  # whitespace right after a block is its end, not content

    def feed(self, delta: str) -> DsmlDelta:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> DsmlDelta:
        """Release everything held; a block left open at the end is content."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> DsmlDelta:
        out = DsmlDelta()
        while True:
            if self._broken:
                out.content += self._buf
                self._buf = ""
                return out
            progressed = self._block_step(out, final) if self._in_block else self._content_step(out, final)
            if not progressed:
                return out

    def _content_step(self, out: DsmlDelta, final: bool) -> bool:
        if self._after_block:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_block = False
        start = self._buf.find(TOOL_CALLS_START)
        if start < 0:
            held = 0 if final else _held_prefix_len(self._buf, TOOL_CALLS_START)
            keep_from = len(self._buf) - held
            if not final:
                keep_from = len(self._buf[:keep_from].rstrip())
            out.content += self._buf[:keep_from]
            self._buf = self._buf[keep_from:]
            return False
        before = self._buf[:start]
        body = before.rstrip()
        out.content += body
        self._block_start = before[len(body) :] + TOOL_CALLS_START
        self._buf = self._buf[start + len(TOOL_CALLS_START) :]
        self._in_block = True
        return True

    def _block_step(self, out: DsmlDelta, final: bool) -> bool:
        pos = _skip_space(self._buf, 0)
        try:
            if self._buf.startswith(TOOL_CALLS_END, pos):
                self._buf = self._buf[pos + len(TOOL_CALLS_END) :]
                self._in_block, self._block_start, self._after_block = False, "", True
                return True
            if TOOL_CALLS_END.startswith(self._buf[pos:]):
                raise _NeedMore
            call, end = _invoke(self._buf, pos, self._names)
        except _NeedMore:
            if final:
                self._fail("the tool-call block ends unfinished")
                return True
            return False
        except _Broken as exc:
            self._fail(str(exc))
            return True
        out.calls.append(call)
        self._buf, self._block_start = self._buf[end:], ""
        return True

    def _fail(self, reason: str) -> None:
        log.warning("DSML tool-call markup did not parse (%s); returning it as content", reason)
        self._buf = self._block_start + self._buf
        self._broken = True


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> DsmlParse:
    """A whole completion's content and tool calls; markup that does not parse stays in the content."""
    parser = DsmlStreamParser(tool_names)
    first, last = parser.feed(text), parser.finish()
    return DsmlParse(first.content + last.content, tuple(first.calls + last.calls))
