"""Grammars from what requests send: a JSON schema, "any JSON object", or Lark text.

Every builder returns an llguidance grammar (a JSON string an `LLMatcher` takes) or raises
`GrammarError` with a message a client can act on. A schema is checked twice: against its JSON
Schema metaschema (`jsonschema`: a misspelt type, a string where a number belongs) and by
llguidance's compiler (what it cannot honour, e.g. an unsupported keyword).

The grammars are Lark whose top rule is `answer`; `reasoning_end` (a thinking model's `</think>`
token id) puts free text closed by that token before it, so a thinking turn reasons freely and
only its answer is constrained. JSON is generated compact (no whitespace between tokens): a
sampled model cannot then spend its token budget on blank space.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from llguidance import LLMatcher

# Compact JSON; keywords llguidance does not implement are errors, not silently dropped.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}
_MAX_ERROR_CHARS = 600


class GrammarError(ValueError):
    """A grammar or schema that cannot constrain decoding; the message says why."""


def check_schema(schema: Any) -> None:
    """Raise GrammarError unless `schema` is a valid JSON Schema (by its own `$schema`'s metaschema,
    the latest draft when it names none)."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        validator = jsonschema.validators.validator_for(schema)
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise GrammarError(f"not a valid JSON Schema at {where}: {exc.message}") from None


def json_value(schema: Any) -> str:
    """The Lark expression of one JSON value valid under `schema` (checked first)."""
    check_schema(schema)
    body = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    return f"%json {json.dumps(body, ensure_ascii=False)}"


def json_schema_grammar(schema: Any, reasoning_end: int | None = None) -> str:
    """The grammar of JSON documents valid under `schema`."""
    return lark_grammar(f"answer: {json_value(schema)}\n", reasoning_end)


def json_object_grammar(reasoning_end: int | None = None) -> str:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"}, reasoning_end)


def lark_grammar(rules: str, reasoning_end: int | None = None) -> str:
    """Lark rules (llguidance's dialect: `%json{...}` embeds a JSON schema) with `answer` as the
    top rule, optionally after free reasoning closed by the token `reasoning_end`."""
    start = "start: answer\n" if reasoning_end is None else f"start: /(?s:.*)/ <[{reasoning_end}]> answer\n"
    grammar = LLMatcher.grammar_from_lark(start + rules)
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    """Raise GrammarError when llguidance's compiler rejects `grammar` (no tokenizer needed)."""
    error = LLMatcher.validate_grammar(grammar)
    if error:  # its first lines say what failed; the rest lists the whole grammar
        raise GrammarError(f"the grammar cannot be compiled: {error[:_MAX_ERROR_CHARS]}")
