"""DeepSeek-V4's chat encoding: for each conversation, the prompt ids equal the ids of the prompt
written out by hand from V4's rules (BOS, markers, thinking tokens, tools, DSML calls, results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from antumbra.replicas.model.tokenizer import Tokenizer, save_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def call(call_id: str, city: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }


def invoke(city: str) -> str:
    return (
        '<｜DSML｜invoke name="get_weather">\n'
        f'<｜DSML｜parameter name="city" string="true">{city}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>"
    )


SYSTEM = {"role": "system", "content": "You are terse."}
Q1, A1 = (
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
)
Q2 = {"role": "user", "content": "2+2?"}
WEATHER_Q = {"role": "user", "content": "Weather in Paris and Rome?"}
CALLS = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "Need the tool.",
    "tool_calls": [call("c1", "Paris"), call("c2", "Rome")],
}
RESULTS = [  # out of call order: V4 orders results as the calls
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
BLOCK = f"\n\n<｜DSML｜tool_calls>\n{invoke('Paris')}\n{invoke('Rome')}\n</｜DSML｜tool_calls>"

# (messages, tools, thinking, expected prompt)
CASES = {
    "system, non-thinking": (
        [SYSTEM, Q1],
        None,
        False,
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>",
    ),
    "system, thinking": ([SYSTEM, Q1], None, True, f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜><think>"),
    "multi-turn, non-thinking": (
        [Q1, A1, Q2],
        None,
        False,
        f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello.{EOS}<｜User｜>2+2?<｜Assistant｜></think>",
    ),
    "multi-turn, thinking drops earlier reasoning": (
        [SYSTEM, Q1, A1, Q2],
        None,
        True,
        f"{BOS}You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello.{EOS}"
        "<｜User｜>2+2?<｜Assistant｜><think>",
    ),
    "tools without a system message": (
        [Q1],
        [TOOL],
        False,
        f"{BOS}\n\n{TOOLS_SECTION}<｜User｜>Hi<｜Assistant｜></think>",
    ),
    "tool calls and results, thinking keeps reasoning": (
        [SYSTEM, WEATHER_Q, CALLS, *RESULTS],
        [TOOL],
        True,
        f"{BOS}You are terse.\n\n{TOOLS_SECTION}<｜User｜>Weather in Paris and Rome?<｜Assistant｜><think>"
        f"Need the tool.</think>{BLOCK}{EOS}"
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜><think>",
    ),
    "tool calls and results, non-thinking, then a final answer and a new question": (
        [WEATHER_Q, CALLS, *RESULTS, {"role": "assistant", "content": "Sunny; rain."}, Q2],
        [TOOL],
        False,
        f"{BOS}\n\n{TOOLS_SECTION}<｜User｜>Weather in Paris and Rome?<｜Assistant｜></think>{BLOCK}{EOS}"
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result><｜Assistant｜></think>"
        f"Sunny; rain.{EOS}<｜User｜>2+2?<｜Assistant｜></think>",
    ),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = save_tokenizer(tmp_path_factory.mktemp("v4"))
    (Path(path) / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return Tokenizer.from_dir(path)


@pytest.mark.parametrize("name", list(CASES))
def test_prompt_ids_are_the_ids_of_the_v4_prompt(tok: Tokenizer, name: str) -> None:
    messages, tools, thinking, expected = CASES[name]
    text = tok.apply_chat_template(messages, tools=tools, thinking=thinking)
    assert text == expected
    ids = tok.encode(text)
    assert ids == tok.encode(expected)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    marker = tok.token_to_id("<think>" if thinking else "</think>")
    assert ids[-2:] == [tok.token_to_id("<｜Assistant｜>"), marker]


def test_unknown_roles_are_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unsupported chat role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
