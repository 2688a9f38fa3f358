"""One chat choice's answer as OpenAI returns it: reasoning, content and tool calls, whole or streamed.

The generated text goes through `replicas.chat.output.ChatOutputParser` (the same parse for both
ways, so a stream and a whole answer agree):
- `reasoning_content` holds the text between the thinking markers (the key is absent when
  thinking is off), `content` the answer without them;
- each DSML tool call becomes an OpenAI `tool_calls` entry with a fresh `call_...` id; in a stream
  a call goes out as OpenAI streams one: a delta with its index, id, type and name (arguments
  empty), then deltas appending argument fragments (one per top-level member of the JSON object).
  A call is streamed once it has parsed completely, so a client never holds half a call;
- the finish reason is `tool_calls` when the answer called tools and stopped by itself.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, model_serializer

from antumbra.replicas.chat.dsml import ToolCall
from antumbra.replicas.chat.output import ChatDelta, ChatOutputParser


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        # `reasoning_content` / `tool_calls` are absent, not null, when there are none (as OpenAI does).
        out = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


def argument_fragments(arguments: str) -> list[str]:
    """The JSON text of an object cut after each top-level member; the pieces join to `arguments`."""
    members = json.loads(arguments)
    if not members:
        return [arguments]
    pieces = [json.dumps({k: v}, ensure_ascii=False)[1:-1] for k, v in members.items()]
    pieces = ["{" + pieces[0], *(", " + p for p in pieces[1:])]
    pieces[-1] += "}"
    return pieces if "".join(pieces) == arguments else [arguments]


class ChatChoiceOutput:
    """Accumulates one choice's answer from the replica's text deltas."""

    def __init__(self, parser: ChatOutputParser | None = None) -> None:
        self._parser = parser or ChatOutputParser(thinking=False)
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCallOut] = []

    def add(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Take generated text; the chunk `delta` objects it releases (possibly none)."""
        step = self._parser.feed(text)
        if final:
            tail = self._parser.finish()
            step = ChatDelta(
                step.reasoning + tail.reasoning, step.content + tail.content, step.calls + tail.calls
            )
        deltas: list[dict[str, Any]] = []
        if step.reasoning:
            self.reasoning.append(step.reasoning)
            deltas.append({"reasoning_content": step.reasoning})
        if step.content:
            self.content.append(step.content)
            deltas.append({"content": step.content})
        for call in step.calls:
            deltas += self._call_deltas(call)
        return deltas

    def count_tokens(self, token_texts: list[str]) -> int:
        """Take the text of each generated token (in order); -> the reasoning tokens so far."""
        counter = self._parser.reasoning_tokens
        for text in token_texts:
            counter.add(text)
        return counter.count

    def _call_deltas(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.calls)
        out = ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCallOut(**vars(call)))
        self.calls.append(out)
        function = {"name": call.name, "arguments": ""}
        deltas = [{"tool_calls": [{"index": index, "id": out.id, "type": "function", "function": function}]}]
        for piece in argument_fragments(call.arguments):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> AssistantMessage:
        content = "".join(self.content)
        return AssistantMessage(
            content=None if self.calls and not content else content,
            reasoning_content="".join(self.reasoning) if self._parser.thinking else None,
            tool_calls=list(self.calls) or None,
        )
