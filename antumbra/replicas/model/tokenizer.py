"""Byte-level tokenizer for tiny checkpoints, and the engine's tokenizer.

`build_byte_tokenizer` / `save_tokenizer` write a tokenizer that
`transformers.AutoTokenizer` loads offline: five DeepSeek-style special tokens
followed by the 256 bytes, with no merges, so any text round-trips.

`Tokenizer` is what the engine uses for every checkpoint. It reads
`tokenizer.json` with the `tokenizers` library and the chat template from
`tokenizer_config.json` with `jinja2`, so a replica does not need transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, processors
from tokenizers.pre_tokenizers import ByteLevel

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

# Ids follow list order: DeepSeek-V4's config defaults are bos 0 and eos 1.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
BYTE_TOKEN_OFFSET = len(SPECIAL_TOKENS)
BYTE_VOCAB_SIZE = BYTE_TOKEN_OFFSET + 256

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# DeepSeek-style: bos, all system text, then the turns; an assistant turn ends with eos.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + message['content'] + eos_token -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
)


def _byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte → printable character map that `ByteLevel` pre-tokenization uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """Specials at ids 0..4, then byte `b` at id `5 + b`; encoding prepends bos."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for byte, char in _byte_to_unicode().items():
        vocab[char] = BYTE_TOKEN_OFFSET + byte
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No merges, so regex splitting would change nothing; skipping it keeps encoding a plain byte map.
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return tok


def save_tokenizer(out_dir: str | Path, *, model_max_length: int = 65536) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(out / TOKENIZER_FILE))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(out / TOKENIZER_CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, ensure_ascii=False, indent=2)
    return out


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are plain strings or AddedToken-style dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _raise_template_exception(message: str) -> None:
    raise ValueError(message)


def _compile_chat_template(source: str) -> Any:
    # The same environment settings transformers uses, so rendered text is identical.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass(frozen=True)
class _SpecialTokens:
    bos: str | None
    eos: str | None
    pad: str | None


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizer.json` plus the chat template of `tokenizer_config.json`."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        special: _SpecialTokens,
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self._special = special
        self._chat_template_source = chat_template
        self._chat_template = _compile_chat_template(chat_template) if chat_template else None
        self._bos_id = self._id_of(special.bos)
        self._eos_id = self._id_of(special.eos)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in checkpoint directory {directory}")
        config: dict[str, Any] = {}
        config_file = directory / TOKENIZER_CONFIG_FILE
        if config_file.is_file():
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        special = _SpecialTokens(
            bos=_token_text(config.get("bos_token")),
            eos=_token_text(config.get("eos_token")),
            pad=_token_text(config.get("pad_token")),
        )
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return cls(tokenizers.Tokenizer.from_file(str(tokenizer_file)), special, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self._special.pad)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with `add_bos`, bos is prepended unless the text already starts with it.

        Chat-templated text begins with the bos token, and a second bos would put the
        prompt off-distribution, so it is not doubled. The post-processor of tokenizer.json
        is bypassed: bos is the only token DeepSeek checkpoints add, and adding it here
        behaves the same whatever the post-processor says.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 tail decodes to replacement characters."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._chat_template is None:
            raise ValueError("this checkpoint's tokenizer_config.json has no chat_template")
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special.bos or "",
            eos_token=self._special.eos or "",
            pad_token=self._special.pad or "",
        )
