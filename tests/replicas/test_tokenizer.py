"""The byte tokenizer: transformers loads it offline, and the engine's Tokenizer agrees with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from antumbra.replicas.model.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    BYTE_TOKEN_OFFSET,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN,
    USER_TOKEN,
    Tokenizer,
    build_byte_tokenizer,
    save_tokenizer,
)

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld — ünïcödé",
    "日本語のテキストと emoji 🙂🚀",
    "mixed <｜User｜> special in text",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "system", "content": "sys one"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "sys two"},
        {"role": "user", "content": "q2 — ünïcödé"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_layout_of_ids() -> None:
    raw = build_byte_tokenizer()
    assert raw.token_to_id(BOS_TOKEN) == 0 and raw.token_to_id(EOS_TOKEN) == 1
    assert raw.get_vocab_size(with_added_tokens=True) == BYTE_VOCAB_SIZE == 261
    assert raw.encode("A", add_special_tokens=False).ids == [BYTE_TOKEN_OFFSET + ord("A")]
    # Each byte is exactly one token.
    text = "é🙂"
    assert len(raw.encode(text, add_special_tokens=False).ids) == len(text.encode())


def test_auto_tokenizer_loads_offline_and_round_trips(hf_tok) -> None:
    assert hf_tok.bos_token_id == 0 and hf_tok.eos_token_id == 1 and hf_tok.pad_token_id is not None
    for text in TEXTS:
        ids = hf_tok.encode(text)
        assert ids[0] == 0
        assert hf_tok.decode(ids, skip_special_tokens=True) == text.replace("<｜User｜>", "")
        assert hf_tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


def test_engine_tokenizer_matches_auto_tokenizer(tok: Tokenizer, hf_tok) -> None:
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.vocab_size == len(hf_tok)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text), text
        assert tok.encode(text, add_bos=False) == hf_tok.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_chat_template_matches_auto_tokenizer(tok: Tokenizer, hf_tok) -> None:
    for messages in CONVERSATIONS:
        for gen_prompt in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen_prompt)
            theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
            assert ours == theirs
            # Encoding the rendered text does not double bos, as tokenizing inside transformers does not.
            hf_ids = hf_tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False
            )
            assert tok.encode(ours) == list(hf_ids)


def test_chat_template_shape(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS[2])
    assert text == (
        f"{BOS_TOKEN}sys one\n\nsys two{USER_TOKEN}q1{ASSISTANT_TOKEN}a1{EOS_TOKEN}"
        f"{USER_TOKEN}q2 — ünïcödé{ASSISTANT_TOKEN}"
    )
    assert not tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False).endswith(
        ASSISTANT_TOKEN
    )
    with pytest.raises(ValueError, match="unsupported chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_decode_of_partial_utf8_does_not_crash(tok: Tokenizer) -> None:
    ids = tok.encode("🙂", add_bos=False)
    assert len(ids) == 4
    for cut in range(1, 4):
        partial = tok.decode(ids[:cut])
        assert isinstance(partial, str) and "🙂" not in partial
    assert tok.decode(ids) == "🙂"
    # Ids past the tokenizer (padded model vocab) are skipped, not an error.
    assert tok.decode([BYTE_TOKEN_OFFSET + ord("a"), BYTE_VOCAB_SIZE + 10]) == "a"


def test_tokenizer_config_names_the_fast_class(tok_dir: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN and cfg["chat_template"]


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
