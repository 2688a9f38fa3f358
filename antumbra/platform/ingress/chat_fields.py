"""The chat request's tool and thinking fields at the REST edge (pydantic), and their checks.

- `tools`: OpenAI function tools; a name is 1-64 of `[A-Za-z0-9_-]` (OpenAI's rule), `parameters`
  a JSON object (the JSON Schema of the arguments).
- `tool_choice`: `"none"` (tools are not offered to the model at all), `"auto"` (default),
  `"required"`, or `{"type": "function", "function": {"name": ...}}` naming one of `tools`.
  Constraining the answer to a call is structured output's part; this edge checks the names.
- `parallel_tool_calls`: whether the answer may hold several calls (default true).
- Thinking: `{"thinking": {"type": "enabled" | "disabled"}}` as DeepSeek's API takes it, or
  `chat_template_kwargs: {"thinking": bool}` (also `enable_thinking`) as vLLM takes it; the
  first wins when both are given; neither: the model's default.
- Messages may be `assistant` turns with `tool_calls` (arguments: a JSON object's text) and
  earlier reasoning (`reasoning_content`), and `tool` results naming their `tool_call_id`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from antumbra.platform.ingress.openai_errors import invalid

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_THINKING_KWARGS = ("thinking", "enable_thinking")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str


class ToolCallMessagePart(BaseModel):
    """One call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ThinkingOption(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "disabled"]


class ChatToolFields(BaseModel):
    """The fields `ChatCompletionRequest` takes for tools and thinking."""

    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_tools(self) -> None:
        """The checks that involve several fields (a 400 naming the parameter)."""
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise invalid("tools: function names must be unique", "tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            known = ", ".join(names) or "none"
            message = f"tool_choice: no tool named {choice.function.name!r} in tools ({known})"
            raise invalid(message, "tool_choice")
        if choice == "required" and not names:
            raise invalid("tool_choice: 'required' needs at least one tool in tools", "tool_choice")

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt describes: none when there are none or `tool_choice` is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def thinking_requested(self) -> bool | None:
        """True / False when the request says, None for the model's default."""
        if self.thinking is not None:
            return self.thinking.type == "enabled"
        for key in _THINKING_KWARGS:
            value = (self.chat_template_kwargs or {}).get(key)
            if value is not None:
                if not isinstance(value, bool):
                    param = f"chat_template_kwargs.{key}"
                    raise invalid(f"{param} must be a boolean", param)
                return value
        return None


def check_call_arguments(calls: list[ToolCallMessagePart], param: str) -> list[dict[str, Any]]:
    """Earlier calls as the encoder takes them; arguments that are not a JSON object are a 400."""
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}].function.arguments"
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            raise invalid(f"{where} must be a JSON object's text", where) from None
        if not isinstance(arguments, dict):
            raise invalid(f"{where} must be a JSON object's text", where)
        out.append(call.model_dump())
    return out
