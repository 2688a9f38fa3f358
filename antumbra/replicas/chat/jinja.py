"""Chat templates in Jinja, for checkpoints whose `tokenizer_config.json` ships one.

Rendered with the environment settings transformers uses, so the text is identical to
`AutoTokenizer.apply_chat_template`. Tools and thinking are passed the way templates commonly
take them (`tools`, `thinking` / `enable_thinking`), but the answer's tool-call format of an
arbitrary template is unknown, so the server offers neither for templated checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any


def _raise_template_exception(message: str) -> None:
    raise ValueError(message)


def compile_chat_template(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class JinjaChatTemplate:
    """A compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self._template = compile_chat_template(source)
        self._special = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        return str(
            self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special
            )
        )
