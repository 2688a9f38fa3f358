"""Grammars from what requests send: a JSON schema, "any JSON object", or Lark text.

Every builder returns an llguidance grammar (a JSON string an `LLMatcher` takes) or raises
`GrammarError` with a message a client can act on. A schema is checked twice: against its JSON
Schema metaschema (`jsonschema`: a misspelt type, a string where a number belongs) and by
llguidance's compiler (what it cannot honour, e.g. an unsupported keyword).

JSON is generated compact (no whitespace between tokens): a sampled model cannot then spend its
token budget on blank space, and the answer is the same JSON a client parses.
"""

from __future__ import annotations

from typing import Any

import jsonschema
from llguidance import LLMatcher

# Compact JSON; keywords llguidance does not implement are errors, not silently dropped.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}


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


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON documents valid under `schema` (checked first)."""
    check_schema(schema)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=dict(_JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
    check_grammar(grammar)
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json{...}` embeds a JSON schema as a rule)."""
    grammar = LLMatcher.grammar_from_lark(text)
    check_grammar(grammar)
    return grammar


def check_grammar(grammar: str) -> None:
    """Raise GrammarError when llguidance's compiler rejects `grammar` (no tokenizer needed)."""
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the grammar cannot be compiled: {error}")

