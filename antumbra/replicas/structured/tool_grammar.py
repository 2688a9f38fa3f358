"""The grammar of a DSML tool-call block (`replicas/chat/dsml.py`) whose calls follow the tools' schemas.

For `tool_choice: "required"` (any of the tools; one call, or several when parallel calls are
allowed) and a named function (exactly one call of it). The grammar is Lark with JSON-schema
rules embedded (`%json{...}`), so the markup and each argument's value are one grammar:

    answer: "\\n\\n" "<" DSML "tool_calls>" NL call (NL call)* NL "</" DSML "tool_calls>"
    call: call_0 | call_1 ...
    call_0: "<" DSML "invoke name=\\"get_weather\\">" (NL param_0_0) (NL param_0_1)? NL "</" DSML "invoke>"

`DSML` is V4's `｜DSML｜` added token, matched as that token (`<[id]>`), so a constrained model
writes the markup as it was trained to, not spelt out in byte pieces.

Parameters follow the schema's `properties` order, required ones mandatory, the others optional;
no other key may appear (what OpenAI's strict function calling guarantees). A value is written
as DSML writes it: a string raw with `string="true"` (its `enum` / `const` as literals, else
`minLength` / `maxLength` / `pattern` as a regex of characters other than `<` and newline, so
the closing tag is unambiguous), anything else as JSON under its own schema with `string="false"`;
a property that may be a string or something else allows both forms.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from antumbra.replicas.chat.dsml import TOOL_CALLS_PREFIX

from .grammars import GrammarError, check_schema, json_value, lark_grammar

# Each its own literal: a literal that ran on into the DSML token ("\n</" before it) would leave
# llguidance's lexer inside an unfinished lexeme when the token arrives.
_NL, _OPEN, _CLOSE = '"\\n"', '"<"', '"</"'


@dataclass(frozen=True)
class ToolSpec:
    """One function a call may name: its name and the JSON schema of its arguments object."""

    name: str
    parameters: dict[str, Any]


def tool_call_grammar(
    tools: Sequence[ToolSpec], dsml_token_id: int, parallel: bool, reasoning_end: int | None = None
) -> str:
    """A grammar for a DSML block calling `tools` (one call unless `parallel`; after free reasoning
    closed by the token `reasoning_end` when given). Raises GrammarError naming the tool whose
    schema cannot constrain its arguments."""
    if not tools:
        raise GrammarError("a tool call needs at least one tool")
    tag = f"<[{dsml_token_id}]>"
    rules = [
        f'answer: {_lit(TOOL_CALLS_PREFIX)} {_OPEN} {tag} {_lit("tool_calls>")} {_NL} call'
        f'{f" ({_NL} call)*" if parallel else ""} {_NL} {_CLOSE} {tag} {_lit("tool_calls>")}',
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        try:
            rules += _call_rules(i, tool, tag)
        except GrammarError as exc:
            raise GrammarError(f"tool {tool.name!r}: {exc}") from None
    return lark_grammar("\n".join(rules) + "\n", reasoning_end)


def _call_rules(i: int, tool: ToolSpec, tag: str) -> list[str]:
    schema = tool.parameters or {"type": "object", "properties": {}}
    check_schema(schema)
    if schema.get("type", "object") != "object":
        raise GrammarError("its parameters must be a JSON schema of type object")
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    missing = required - set(properties)
    if missing:
        raise GrammarError(f"required parameters without a schema: {sorted(missing)}")
    parts = []
    rules = []
    for j, (key, prop) in enumerate(properties.items()):
        name = f"param_{i}_{j}"
        prop_schema = _with_definitions(prop if isinstance(prop, dict) else {}, schema)
        rules += _param_rules(name, key, prop_schema, tag)
        item = f"({_NL} {name})"
        parts.append(item if key in required else item + "?")
    header = f'{_OPEN} {tag} {_lit(f"invoke name={json.dumps(tool.name)}>")}'
    closing = f'{_NL} {_CLOSE} {tag} {_lit("invoke>")}'
    return [" ".join([f"call_{i}:", header, *parts, closing]), *rules]


def _with_definitions(prop: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """A property's schema carrying the root's definitions, so its `#/$defs/...` refs resolve alone."""
    shared: dict[str, Any] = {k: root[k] for k in ("$defs", "definitions") if k in root and k not in prop}
    return {**prop, **shared} if shared else prop


def _param_rules(name: str, key: str, schema: dict[str, Any], tag: str) -> list[str]:
    """`name`: the value forms `key` may take (a raw string and / or JSON)."""
    open_tag = f'{_OPEN} {tag} {_lit(f"parameter name={json.dumps(key)} string=")}'
    close_tag = f'{_CLOSE} {tag} {_lit("parameter>")}'
    forms = []
    shape = _resolved(schema)  # what the value's type is read from (a local $ref followed)
    string_form = _raw_string(shape)
    if string_form is not None:
        forms.append(f'{open_tag} {_lit(chr(34) + "true" + chr(34) + ">")} {string_form} {close_tag}')
    if _may_be_other_than_string(shape):
        forms.append(f'{open_tag} {_lit(chr(34) + "false" + chr(34) + ">")} {json_value(schema)} {close_tag}')
    if not forms:
        raise GrammarError(f"parameter {key!r} has no value its schema allows")
    return [f"{name}: " + " | ".join(forms)]


def _resolved(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema a local `#/$defs/NAME` (or `#/definitions/NAME`) reference points to, else itself."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    section, _, name = ref[2:].partition("/")
    target = (schema.get(section) or {}).get(name)
    return target if isinstance(target, dict) else schema


def _types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types the schema names (None: any)."""
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return {"string" if isinstance(v, str) else "other" for v in values}
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def _may_be_other_than_string(schema: dict[str, Any]) -> bool:
    types = _types(schema)
    return types is None or bool(types - {"string"})


def _raw_string(schema: dict[str, Any]) -> str | None:
    """The Lark expression of the raw string values the schema allows, None when none."""
    types = _types(schema)
    if types is not None and "string" not in types:
        return None
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        strings = [v for v in values if isinstance(v, str)]
        return "(" + " | ".join(_lit(v) for v in strings) + ")"
    if "pattern" in schema:
        return f"/{_regex_body(schema['pattern'])}/"
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    count = f"{{{low},{int(high)}}}" if high is not None else (f"{{{low},}}" if low else "*")
    return f"/[^<\\n]{count}/"


def _regex_body(pattern: str) -> str:
    """A JSON-schema pattern (a search, unanchored) as a whole-value regex in a Lark /.../ literal."""
    body = pattern
    body = body[1:] if body.startswith("^") else "[^<\\n]*" + body
    body = body[:-1] if body.endswith("$") else body + "[^<\\n]*"
    return body.replace("/", "\\/")


def _lit(text: str) -> str:
    """A Lark string literal (JSON escapes)."""
    return json.dumps(text, ensure_ascii=False)

