"""A request's structured-output settings as the grammar its replica decodes under.

`response_format` `json_object` / `json_schema` become JSON grammars; `tool_choice` `"required"`
or a named function becomes the grammar of a DSML tool-call block over the allowed tools
(`replicas/structured/tool_grammar.py`). Every schema is checked here, before the request is
routed: a schema that is not valid JSON Schema, or one llguidance cannot compile, is a 400 that
names the parameter, and nothing reaches a replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from antumbra.platform.ingress.openai_errors import invalid
from antumbra.replicas.chat.dsml import DSML_TOKEN
from antumbra.replicas.chat.v4_tokens import THINK_END
from antumbra.replicas.structured.grammars import json_object_grammar, json_schema_grammar
from antumbra.replicas.structured.tool_grammar import ToolSpec, tool_call_grammar

# What a client's schema can make the builders raise (GrammarError is a ValueError; a schema nested
# past Python's recursion limit fails in the metaschema check): a 400, never a 500.
_SCHEMA_FAILURES = (ValueError, TypeError, RecursionError)


def request_grammar(body: Any, tokenizer: Any, thinking: bool = False) -> str | None:
    """The llguidance grammar the request's output must follow, None when it is free. A tool
    choice that forces a call wins over `response_format` (the answer is then the call). With
    `thinking` the turn first reasons freely up to `</think>`; only the answer is constrained."""
    reasoning_end = tokenizer.token_to_id(THINK_END) if thinking else None
    tools = _tool_specs(getattr(body, "tools", None))
    forced = _forced_tools(tools, getattr(body, "tool_choice", None))
    if forced is not None:
        dsml_id = tokenizer.token_to_id(DSML_TOKEN)
        if dsml_id is None:
            raise invalid("this model's vocabulary has no DSML token: it cannot be made to call tools",
                          "tool_choice")
        # A named function is called once; "required" may call several when parallel calls are on.
        parallel = not _is_named(body) and getattr(body, "parallel_tool_calls", None) is not False
        try:
            return tool_call_grammar(forced, dsml_id, parallel=parallel, reasoning_end=reasoning_end)
        except _SCHEMA_FAILURES as exc:
            raise invalid(str(exc), "tools") from None
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_object_grammar(reasoning_end)
    schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
    try:
        return json_schema_grammar({} if schema is None else schema, reasoning_end)
    except _SCHEMA_FAILURES as exc:
        param = "response_format.json_schema.schema"
        raise invalid(f"{param}: {exc}", param) from None


def _is_named(body: Any) -> bool:
    choice = getattr(body, "tool_choice", None)
    return choice is not None and not isinstance(choice, str)


def _as_dict(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(by_alias=True, exclude_none=True) if dump is not None else value


def _tool_specs(tools: Sequence[Any] | None) -> list[ToolSpec]:
    specs = []
    for tool in tools or ():
        function = _as_dict(tool).get("function") or {}
        specs.append(ToolSpec(str(function.get("name", "")), function.get("parameters") or {}))
    return specs


def _forced_tools(tools: list[ToolSpec], choice: Any) -> list[ToolSpec] | None:
    """The tools a call must be made to, None when no call is forced."""
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        if not tools:
            raise invalid('tool_choice "required" needs tools', "tool_choice")
        return tools
    name = (_as_dict(choice).get("function") or {}).get("name") if not isinstance(choice, str) else None
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise invalid(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
    return chosen[:1]
