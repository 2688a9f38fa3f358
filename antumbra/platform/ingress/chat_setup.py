"""What a chat request asks of the model's chat encoding: the messages, the tools offered, thinking.

Checked against what the served model's encoding can carry (a 400 naming the parameter): tools
need an encoding with a tool-call format (DeepSeek-V4's DSML), and thinking asked for explicitly
needs one that can think; an unasked thinking default is used only where it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from antumbra.platform.ingress.openai_errors import invalid
from antumbra.platform.ingress.served_model import ServedModel
from antumbra.replicas.chat.output import ChatOutputParser


@dataclass(frozen=True)
class ChatSetup:
    """`tool_choice` is "auto", "required" or "named" (`named_tool`); "none" offers no tools;
    structured output constrains the answer to a call for the last two."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # described in the prompt, and calls parsed from the answer
    thinking: bool
    tool_choice: str = "auto"
    named_tool: str | None = None  # tool_choice {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool = True

    def output_parser(self) -> ChatOutputParser:
        names = [t["function"]["name"] for t in self.tools] if self.tools else None
        return ChatOutputParser(thinking=self.thinking, tool_names=names,
                                max_calls=None if self.parallel_tool_calls else 1)

    def routing_messages(self) -> list[dict[str, str]]:
        """Role and text only: what prefix-affinity routers read."""
        return [{"role": m["role"], "content": m.get("content") or ""} for m in self.messages]


def chat_setup(model: ServedModel, body: Any) -> ChatSetup:
    encoding = model.tokenizer.chat_encoding
    tools = body.offered_tools
    if tools and (encoding is None or not encoding.supports_tools):
        name = encoding.name if encoding else "no"
        raise invalid(
            f"tools: the model `{model.name}` has {name} chat encoding, which cannot carry tool calls",
            "tools",
        )
    asked = body.thinking_requested()
    can_think = encoding is not None and encoding.supports_thinking
    if asked and not can_think:
        raise invalid(f"thinking: the model `{model.name}` has no thinking mode", "thinking")
    thinking = can_think and (model.thinking_default if asked is None else asked)
    choice = body.tool_choice
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    mode = "auto" if not tools else ("named" if named else (choice or "auto"))
    return ChatSetup(body.template_messages(), tools, thinking, mode, named, body.parallel_tool_calls)
