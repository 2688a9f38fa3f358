"""The tool section DeepSeek-V4 reads in its system prompt: how to call tools in DSML, then the schemas.

The wording is part of what the model was trained on, so it is reproduced exactly as V4's
encoding writes it; the schemas are each tool's OpenAI `function` object as compact JSON with
`ensure_ascii=False` (one per line, in the request's order).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from antumbra.replicas.chat.dsml import DSML_TOKEN
from antumbra.replicas.chat.v4_tokens import THINK_END, THINK_START

_D = DSML_TOKEN
TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<{_D}tool_calls>" block like the following:

<{_D}tool_calls>
<{_D}invoke name="$TOOL_NAME">
<{_D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{_D}parameter>
...
</{_D}invoke>
<{_D}invoke name="$TOOL_NAME2">
...
</{_D}invoke>
</{_D}tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning \
inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def tool_json(value: Any) -> str:
    """JSON as V4's encoding writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool section for OpenAI-shaped `tools` (`{"type": "function", "function": {...}}`)."""
    schemas = "\n".join(tool_json(t["function"]) for t in tools)
    return TOOLS_HEADER + schemas + TOOLS_FOOTER
