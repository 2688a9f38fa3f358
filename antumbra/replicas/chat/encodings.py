"""Which chat encoding a checkpoint gets, and what it can carry.

A checkpoint that ships a Jinja `chat_template` is rendered with it (its own format wins). Else
its `model_type` picks an encoder written as code: DeepSeek-V4 (`encoding_v4`), which carries
tools (DSML) and thinking. A checkpoint with neither has no chat encoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from antumbra.replicas.chat.encoding_v4 import encode_v4
from antumbra.replicas.chat.jinja import JinjaChatTemplate

V4_MODEL_TYPES = ("deepseek_v4",)


@dataclass(frozen=True)
class ChatEncoding:
    """How messages become a prompt, and what the answer may hold (`output.ChatOutputParser`)."""

    name: str
    supports_tools: bool
    supports_thinking: bool
    template: JinjaChatTemplate | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
    ) -> str:
        if tools and not self.supports_tools:
            raise ValueError(f"the {self.name} chat encoding cannot carry tools")
        if self.template is not None:
            return self.template.render(messages)
        return encode_v4(messages, tools=tools, thinking=thinking)


def chat_encoding_for(model_type: str | None, template: JinjaChatTemplate | None) -> ChatEncoding | None:
    if template is not None:
        return ChatEncoding("chat_template", supports_tools=False, supports_thinking=False, template=template)
    if model_type in V4_MODEL_TYPES:
        return ChatEncoding("deepseek_v4", supports_tools=True, supports_thinking=True)
    return None
