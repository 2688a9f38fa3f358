"""What a chat request may ask of a model's chat encoding: tools need one with a tool-call format,
thinking one that can think, and the model spec's default decides when the request does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from antumbra.platform.ingress.chat_setup import chat_setup
from antumbra.platform.ingress.openai_errors import ApiError
from antumbra.platform.ingress.openai_requests import ChatCompletionRequest, parse_request
from antumbra.platform.ingress.served_model import ServedModel
from antumbra.replicas.model.tokenizer import Tokenizer, save_tokenizer

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _model(directory: Path, thinking_default: bool = False) -> ServedModel:
    tok = Tokenizer.from_dir(directory)
    return ServedModel(
        name="m", handle=None, stream_handle=None, tokenizer=tok, thinking_default=thinking_default
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    v4 = save_tokenizer(tmp_path_factory.mktemp("v4"))
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    templated = save_tokenizer(tmp_path_factory.mktemp("templated"))
    config = json.loads((templated / "tokenizer_config.json").read_text(encoding="utf-8"))
    (templated / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return {"v4": v4, "templated": templated}


def _body(**fields: object) -> ChatCompletionRequest:
    return parse_request(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_tools_need_an_encoding_that_carries_them(dirs: dict[str, Path]) -> None:
    with pytest.raises(ApiError) as err:
        chat_setup(_model(dirs["templated"]), _body(tools=[TOOL]))
    assert err.value.status == 400 and err.value.param == "tools"
    assert chat_setup(_model(dirs["v4"]), _body(tools=[TOOL])).tools == [TOOL]
    # tool_choice "none": the tools are not offered, so any encoding takes the request.
    assert chat_setup(_model(dirs["templated"]), _body(tools=[TOOL], tool_choice="none")).tools is None


def test_thinking_follows_the_request_then_the_model_default(dirs: dict[str, Path]) -> None:
    v4, v4_thinks = _model(dirs["v4"]), _model(dirs["v4"], thinking_default=True)
    assert not chat_setup(v4, _body()).thinking
    assert chat_setup(v4_thinks, _body()).thinking
    assert chat_setup(v4, _body(thinking={"type": "enabled"})).thinking
    assert not chat_setup(v4_thinks, _body(chat_template_kwargs={"enable_thinking": False})).thinking
    # The DeepSeek-style field wins over chat_template_kwargs.
    both = _body(thinking={"type": "disabled"}, chat_template_kwargs={"thinking": True})
    assert not chat_setup(v4, both).thinking
    templated = _model(dirs["templated"], thinking_default=True)
    assert not chat_setup(templated, _body()).thinking  # a default the encoding cannot honour is moot
    with pytest.raises(ApiError) as err:
        chat_setup(templated, _body(thinking={"type": "enabled"}))
    assert err.value.param == "thinking"


def test_tool_choice_reaches_the_setup(dirs: dict[str, Path]) -> None:
    v4 = _model(dirs["v4"])
    named = _body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    setup = chat_setup(v4, named)
    assert (setup.tool_choice, setup.named_tool, setup.parallel_tool_calls) == ("named", "f", True)
    required = chat_setup(v4, _body(tools=[TOOL], tool_choice="required", parallel_tool_calls=False))
    assert (required.tool_choice, required.parallel_tool_calls) == ("required", False)
    assert chat_setup(v4, _body(tools=[TOOL])).tool_choice == "auto"
