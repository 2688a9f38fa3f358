"""Splitting generated text into reasoning (between V4's thinking markers) and the answer.

In thinking mode V4's prompt ends with `<think>`, so the output opens inside the thought and
`</think>` ends it; in non-thinking mode the prompt ends with `</think>` and all output is the
answer. A model (a random tiny one, or a real one off track) may still emit the markers anywhere,
so the split never trusts them to be well placed:

- thinking mode: text up to the first `</think>` is reasoning; after it, a `<think>` opens
  another stretch of reasoning (appended to it) until the next `</think>`;
- non-thinking mode: there is no reasoning; stray markers are dropped from the answer.

Either way the answer never carries a marker. `ReasoningStreamParser.feed` releases text as soon
as it cannot be part of a marker (a partial marker at the end is held), and `split_reasoning`
is the same parse over a whole text. `ReasoningTokenCounter` runs the same split one generated
token at a time, to count the completion tokens that are reasoning (what usage reports as
`reasoning_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from antumbra.replicas.chat.v4_tokens import THINK_END, THINK_START

_MARKERS = (THINK_START, THINK_END)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    for n in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in _MARKERS):
            return n
    return 0


class ReasoningStreamParser:
    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self._in_thought = thinking
        self._buf = ""
        self.markers_seen = 0  # thinking markers consumed so far

    @property
    def in_thought(self) -> bool:
        """Is the text fed so far inside a thought (what follows would be reasoning)?"""
        return self._in_thought

    def feed(self, delta: str) -> ReasoningDelta:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self._in_thought:
            out.reasoning += text
        else:
            out.content += text

    def _drain(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            found = [(self._buf.find(m), m) for m in _MARKERS if m in self._buf]
            if not found:
                keep = 0 if final else _held_len(self._buf)
                self._emit(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            at, marker = min(found)
            self._emit(out, self._buf[:at])
            self._buf = self._buf[at + len(marker) :]
            self._in_thought = self.thinking and marker == THINK_START
            self.markers_seen += 1


class ReasoningTokenCounter:
    """Counts the generated tokens inside the reasoning, fed each token's text in order.

    A token is reasoning when the thought is open before and after it and it completes no marker:
    V4's `</think>` (one token) closes the count and is not in it, as OpenAI's `reasoning_tokens`
    counts the thought and not its delimiters. Without thinking nothing is reasoning.
    """

    def __init__(self, thinking: bool) -> None:
        self._split = ReasoningStreamParser(thinking)
        self.count = 0

    def add(self, token_text: str) -> None:
        before, markers = self._split.in_thought, self._split.markers_seen
        self._split.feed(token_text)
        if before and self._split.in_thought and self._split.markers_seen == markers:
            self.count += 1


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """`(reasoning, content)` of a whole output; reasoning is None when thinking is off."""
    parser = ReasoningStreamParser(thinking)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if thinking else None), first.content + last.content
