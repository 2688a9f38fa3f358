"""DeepSeek-V4's chat encoding: OpenAI-shaped messages to the prompt text V4 was trained on.

DeepSeek ships V4's chat format as Python beside the weights (`encoding/encoding_dsv4.py`), not
as a Jinja template. The rules it follows, which this module implements:

1. The prompt starts with BOS `<｜begin▁of▁sentence｜>`.
2. A system message is its content as is (no marker). Tools, when the request has any, are
   described in the system part: `"\\n\\n"` + the tool section (`tool_prompt.render_tools`) after
   the content of the conversation's first system message (an empty one is put first when the
   conversation has none).
3. A user message is `<｜User｜>` + its content.
4. Tool results carry no role of their own: consecutive `tool` messages (and user text that
   follows them) form one user turn, `<｜User｜>` + blocks joined by `"\\n\\n"`, each result
   `<tool_result>{content}</tool_result>`, ordered as the calls of the assistant turn before.
5. A user turn followed by an assistant turn, or ending the conversation, is followed by
   `<｜Assistant｜>` and a thinking token: `<think>` when that answer is (to be) given in
   thinking mode, `</think>` when it is not (non-thinking answers open with an empty thought).
6. An assistant turn is `[reasoning + "</think>"] + content + [DSML tool calls] + EOS`; the
   reasoning part appears only in thinking mode and only for the turns whose reasoning is kept.
   Tool calls follow as `dsml.render_tool_calls` writes them.
7. Earlier turns' reasoning is dropped: in thinking mode, assistant turns before the last user
   turn lose their reasoning and are encoded as non-thinking turns (their user turn ends in
   `</think>`); only the turns after the last user turn keep theirs. When the request has tools,
   nothing is dropped (an agent's reasoning across tool calls stays in context) and every user
   turn opens a thought.

A client sends earlier reasoning back as `reasoning_content` (DeepSeek's API) or `reasoning`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from antumbra.replicas.chat.dsml import ToolCall, render_tool_calls
from antumbra.replicas.chat.tool_prompt import render_tools
from antumbra.replicas.chat.v4_tokens import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    THINK_END,
    THINK_START,
    USER_TOKEN,
)

Message = Mapping[str, Any]
TOOL_RESULT = "<tool_result>{}</tool_result>"


def _tool_calls(message: Message) -> list[ToolCall]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(function["name"], arguments))
    return calls


def _merge_tool_results(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Rule 4: `tool` messages, and user text right after them, become one user turn of blocks.

    A block is `(call index, text)` for a result and `(None, text)` for user text.
    """
    merged: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            call_order = {c.get("id", ""): i for i, c in enumerate(message["tool_calls"])}
        open_results = bool(merged) and merged[-1].get("blocks") is not None
        if role == "tool":
            block = (call_order.get(message.get("tool_call_id", ""), 0), message.get("content") or "")
            if open_results:
                merged[-1]["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user" and open_results:
            merged[-1]["blocks"].append((None, message.get("content") or ""))
        else:
            merged.append(dict(message))
    return merged


def _user_text(message: Mapping[str, Any]) -> str:
    blocks = message.get("blocks")
    if blocks is None:
        return message.get("content") or ""
    # Results are put in the order of the calls; user text keeps its place.
    results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
    parts = [text if order is None else TOOL_RESULT.format(next(results)[1]) for order, text in blocks]
    return "\n\n".join(parts)


def _with_tools(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rule 2: the tools go with the first system message (a new empty one if there is none)."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def _assistant(message: Mapping[str, Any], keep_reasoning: bool) -> str:
    thought = ""
    if keep_reasoning:
        thought = (message.get("reasoning_content") or message.get("reasoning") or "") + THINK_END
    calls = _tool_calls(message)
    block = render_tool_calls(calls) if calls else ""
    return thought + (message.get("content") or "") + block + EOS_TOKEN


def encode_v4(
    messages: Sequence[Message], *, tools: Sequence[Mapping[str, Any]] | None = None, thinking: bool = False
) -> str:
    """The V4 prompt text for `messages` (roles system, user, assistant, tool), ready to generate."""
    turns = _merge_tool_results(messages)
    if tools:
        turns = _with_tools(turns, tools)
    keep_all = bool(tools)
    last_user = max((i for i, t in enumerate(turns) if t.get("role") == "user"), default=-1)
    prompt = BOS_TOKEN
    for i, turn in enumerate(turns):
        role = turn.get("role")
        if role == "system":
            prompt += turn.get("content") or ""
            if turn.get("tools"):
                prompt += "\n\n" + render_tools(turn["tools"])
        elif role == "user":
            prompt += USER_TOKEN + _user_text(turn)
            if i + 1 == len(turns) or turns[i + 1].get("role") == "assistant":
                opens_thought = thinking and (keep_all or i >= last_user)
                prompt += ASSISTANT_TOKEN + (THINK_START if opens_thought else THINK_END)
        elif role == "assistant":
            prompt += _assistant(turn, keep_reasoning=thinking and (keep_all or i > last_user))
        else:
            raise ValueError(f"unsupported chat role: {role!r}")
    return prompt
