"""Structured output in the engine: grammars from schemas and tool lists, the matcher's masks, and
constrained generation on a tiny random model with the real DeepSeek-V4 tokenizer.

A random model follows no instruction: whatever it emits under a grammar is the grammar's doing,
so every answer that finishes must parse and validate. Schemas here bound their strings and
numbers so that the grammar ends within a few tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer

from antumbra import Engine, SamplingParams
from antumbra.kernels.token_mask import unpack_bits_reference, words_for
from antumbra.replicas.chat.dsml import ToolCall, render_tool_calls
from antumbra.replicas.errors import InvalidRequestError
from antumbra.replicas.model.tokenizer import Tokenizer, v4_tokenizer_file
from antumbra.replicas.structured import GrammarError, json_object_grammar, json_schema_grammar
from antumbra.replicas.structured.tool_grammar import ToolSpec, tool_call_grammar

V4_VOCAB = 129_280
DSML_ID = 128825
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = ToolSpec("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1,
                                                                       "maximum": 7}},
    "required": ["city", "days"],
})
SEARCH = ToolSpec("search", {
    "type": "object",
    "properties": {
        "q": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["q"],
})


@pytest.fixture(scope="module")
def tokenizer() -> LLTokenizer:
    return LLTokenizer(v4_tokenizer_file().read_text(), n_vocab=V4_VOCAB, eos_token=1)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    """The tiny checkpoints carry the real V4 tokenizer.json and its 129,280-row vocabulary."""
    eng = Engine.from_pretrained(tiny_checkpoint)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def encode():  # type: ignore[no-untyped-def]
    tok = Tokenizer.from_dir(v4_tokenizer_file().parent)
    return lambda text: tok.encode(text, add_bos=False)


def test_mask_bits_follow_llguidance_layout(tokenizer: LLTokenizer) -> None:
    """Token t is bit t % 32 of word t // 32: what llguidance writes for a grammar allowing one token."""
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark('start: "{"'))
    mask = np.zeros((1, words_for(V4_VOCAB)), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    allowed = unpack_bits_reference(torch.from_numpy(mask), V4_VOCAB)[0].nonzero().flatten().tolist()
    assert [tokenizer.decode_str([t]) for t in allowed] == ["{"]


@pytest.mark.parametrize("schema, where", [
    ({"type": "strnig"}, "type"),
    ({"type": "object", "properties": {"a": {"maxLength": -1}}}, "properties/a/maxLength"),
    ({"type": "object", "required": "a"}, "required"),
])
def test_schemas_that_are_not_json_schema_are_refused(schema: dict, where: str) -> None:
    with pytest.raises(GrammarError, match=f"not a valid JSON Schema at {where}"):
        json_schema_grammar(schema)


def test_a_schema_llguidance_cannot_honour_is_refused() -> None:
    with pytest.raises(GrammarError, match="cannot be compiled"):
        json_schema_grammar({"type": "string", "format": "no-such-format"})


def test_tool_grammar_takes_rendered_calls_and_refuses_others(
    tokenizer: LLTokenizer, encode  # type: ignore[no-untyped-def]
) -> None:
    grammar = tool_call_grammar([WEATHER, SEARCH], DSML_ID, parallel=True)
    good = [
        [ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3}))],
        [ToolCall("search", json.dumps({"q": None, "tags": ["b"]})),
         ToolCall("search", json.dumps({"q": "x"}))],
    ]
    for calls in good:
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        assert matcher.consume_tokens(encode(render_tool_calls(calls))), matcher.get_error()
        assert matcher.is_stopped()
    bad = [
        [ToolCall("get_weather", json.dumps({"city": "Paris, France", "days": 3}))],  # too long
        [ToolCall("get_weather", json.dumps({"city": "Oslo", "days": 9}))],  # over its maximum
        [ToolCall("get_weather", json.dumps({"days": 3}))],  # a required parameter missing
        [ToolCall("lookup", json.dumps({"q": "x"}))],  # not a tool
    ]
    for calls in bad:
        assert not LLMatcher(tokenizer, grammar, log_level=0).consume_tokens(encode(render_tool_calls(calls)))
    single = tool_call_grammar([WEATHER, SEARCH], DSML_ID, parallel=False)
    assert not LLMatcher(tokenizer, single, log_level=0).consume_tokens(encode(render_tool_calls(good[1])))


def test_tool_schema_errors_name_the_tool() -> None:
    with pytest.raises(GrammarError, match="tool 'broken'"):
        tool_call_grammar([ToolSpec("broken", {"type": "object", "properties": {"a": {"type": 3}}})],
                          DSML_ID, parallel=False)


def test_json_schema_answers_validate_and_unconstrained_rows_are_untouched(engine: Engine) -> None:
    grammar = json_schema_grammar(PERSON)
    constrained = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, grammar=grammar) for s in range(4)]
    free = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    alone = engine.generate(["hi"], free)[0]
    outs = engine.generate(["hi"] * 5, [*constrained, free])
    for out in outs[:4]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert outs[4].token_ids == alone.token_ids  # masks of other rows change nothing of its draw
    assert engine.stats()  # the engine is still serving
    again = engine.generate(["hi"], constrained[0])[0]
    assert again.token_ids == outs[0].token_ids  # seeded constrained rows reproduce


def test_json_object_and_greedy_rows_parse(engine: Engine) -> None:
    params = [SamplingParams(max_tokens=16, temperature=0.0, grammar=json_object_grammar()),
              SamplingParams(max_tokens=16, temperature=0.0, grammar=json_schema_grammar(PERSON))]
    outs = engine.generate(["{"] * 2, params)
    assert isinstance(json.loads(outs[0].text), dict)
    jsonschema.validate(json.loads(outs[1].text), PERSON)


def test_a_grammar_the_replica_cannot_compile_is_an_invalid_request(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="grammar"):
        bad = '{"grammars": [{"lark_grammar": "start: nope"}]}'
        engine.core.make_request("hi", SamplingParams(grammar=bad))


def test_tool_parameters_may_refer_to_shared_definitions(tokenizer: LLTokenizer, encode) -> None:  # type: ignore[no-untyped-def]
    tool = ToolSpec("book", {
        "type": "object",
        "$defs": {"day": {"type": "integer", "minimum": 1, "maximum": 31}},
        "properties": {"day": {"$ref": "#/$defs/day"}},
        "required": ["day"],
    })
    grammar = tool_call_grammar([tool], DSML_ID, parallel=False)
    ok = render_tool_calls([ToolCall("book", json.dumps({"day": 12}))])
    assert LLMatcher(tokenizer, grammar, log_level=0).consume_tokens(encode(ok))
    bad = render_tool_calls([ToolCall("book", json.dumps({"day": 40}))])
    assert not LLMatcher(tokenizer, grammar, log_level=0).consume_tokens(encode(bad))


def test_reasoning_runs_free_until_its_end_token_then_the_answer_is_constrained(
    tokenizer: LLTokenizer, encode  # type: ignore[no-untyped-def]
) -> None:
    think_end = 128822  # </think>
    grammar = json_schema_grammar(PERSON, reasoning_end=think_end)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(encode('Any {text} "here".</think>{"name":"Al","age":3,"ok":true}'))
    assert matcher.is_stopped()
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.consume_tokens(encode('thinking</think>{"name":"Alice","age":3,"ok":true}'))



def test_constrained_rows_overlap_their_steps_and_draw_what_the_general_path_draws(
    tiny_checkpoint: Path, engine: Engine
) -> None:
    """On the fixed-shape decode step with overlap scheduling (kernels interpreted on CPU): the
    masks are computed while each step's forward runs, and the tokens equal the general step's."""
    from antumbra.config import FastPathConfig, SchedulerConfig

    pair = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
            "maxItems": 2}
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=0, grammar=json_schema_grammar(pair)),
              SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)]
    want = engine.generate(["hi"] * 2, params)  # the module's engine takes the general step on CPU
    fast = Engine.from_pretrained(tiny_checkpoint,
                                  scheduler=SchedulerConfig(max_model_len=256, max_num_seqs=2),
                                  fast=FastPathConfig(decode="on", cuda_graph_batch_sizes=(2,)))
    got = fast.generate(["hi"] * 2, params)
    overlapped = fast.core.overlap.num_overlapped_steps
    fast.shutdown()
    assert overlapped > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["stop", "length"]
    jsonschema.validate(json.loads(got[0].text), pair)
