"""A request body's JSON: the fast parser accepts exactly what the reference parser (`json.loads`,
no NaN or Infinity) accepts, with the same values, and every refusal is a 400 naming the problem."""

from __future__ import annotations

import json
import math
import random

import pytest

from antumbra.platform.ingress.openai_errors import ApiError
from antumbra.platform.ingress.request_body import parse_body

ACCEPTED = [
    b'{"model": "m", "prompt": "hello", "max_tokens": 16}',
    b'{"a": [1, -2, 3.5, 1e-7, 123456789012345678901234567890, true, false, null]}',
    '{"text": "Grüße, 世界 \\u00e9 \\ud83d\\ude00"}'.encode(),
    b'{"lone": "\\ud800"}',  # a lone surrogate parses; the prompt's validator refuses it by name
    b'{"a": 1, "a": 2}',  # the last value wins, as in json.loads
    b'{"huge": 1e400}',  # a number too large for a float is infinity in both parsers
    b'[' * 300 + b']' * 300,  # deeper than the fast parser goes, within Python's limit
    b' \n{"spaced": {}}\t ',
    b'"a string"',
]

REFUSED = [
    (b'{"a": NaN}', "NaN is not valid JSON"),
    (b'{"a": Infinity}', "Infinity is not valid JSON"),
    (b'{"a": -Infinity}', "-Infinity is not valid JSON"),
    (b'{"a": 1} trailing', "Extra data"),
    (b'{"a": ', "Expecting value"),
    (b'{"a": "\xff"}', "can't decode"),
    (b'[' * 100_000 + b']' * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize("body", ACCEPTED, ids=range(len(ACCEPTED)))
def test_accepted_bodies_parse_to_the_reference_values(body: bytes) -> None:
    parsed, reference = parse_body(body), json.loads(body)
    assert parsed == reference or (math.isinf(parsed["huge"]) and math.isinf(reference["huge"]))
    assert json.dumps(parsed) == json.dumps(reference)  # the same types, not only equal values


def test_a_long_prompt_of_token_ids_parses_to_the_same_ints() -> None:
    ids = [random.Random(7).randrange(1 << 20) for _ in range(16384)]
    body = json.dumps({"model": "m", "prompt": ids, "stream": True}).encode()
    parsed = parse_body(body)
    assert parsed["prompt"] == ids and all(type(t) is int for t in parsed["prompt"])


@pytest.mark.parametrize(("body", "named"), REFUSED, ids=range(len(REFUSED)))
def test_refused_bodies_are_a_400_that_names_the_problem(body: bytes, named: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_body(body)
    assert err.value.status == 400
    assert "not valid JSON" in str(err.value.message) and named in str(err.value.message)
