"""The V4 tokenizer files tiny checkpoints carry: transformers loads them offline, and the engine's
Tokenizer agrees with it; a shipped Jinja template is honoured; the directory's own file wins."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from antumbra.replicas.chat.dsml import DSML_TOKEN
from antumbra.replicas.chat.v4_tokens import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    THINK_END,
    THINK_START,
    USER_TOKEN,
    V4_VOCAB_SIZE,
)
from antumbra.replicas.model.tokenizer import Tokenizer, save_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld — ünïcödé 12345",
    "日本語のテキストと emoji 🙂🚀",
    "mixed <｜User｜> and <think>markers</think> in text",
    "",
]

# DeepSeek-style: bos, all system text, then the turns (a checkpoint that ships its own template).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported chat role: ' + m['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
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


def test_v4_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == V4_VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 1)
    expected = {USER_TOKEN: 128803, ASSISTANT_TOKEN: 128804, THINK_START: 128821, THINK_END: 128822}
    for token, token_id in {**expected, DSML_TOKEN: 128825}.items():
        assert tok.token_to_id(token) == token_id
        assert tok.encode(token, add_bos=False) == [token_id]
    # A DSML tag is "<" + the DSML token + its name, as V4 was trained to write it.
    assert tok.encode(f"<{DSML_TOKEN}invoke", add_bos=False)[:2] == [tok.token_to_id("<"), 128825]


def test_auto_tokenizer_loads_offline_and_agrees(tok: Tokenizer, hf_tok) -> None:
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert len(hf_tok) == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0
        assert tok.encode(text, add_bos=False) == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_v4_checkpoint_without_a_template_needs_its_model_type(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no chat encoding"):
        Tokenizer.from_dir(tok_dir).apply_chat_template([{"role": "user", "content": "x"}])
    v4 = save_tokenizer(tmp_path / "v4")
    (v4 / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    text = Tokenizer.from_dir(v4).apply_chat_template([{"role": "user", "content": "x"}])
    assert text == f"{BOS_TOKEN}{USER_TOKEN}x{ASSISTANT_TOKEN}{THINK_END}"


def test_a_shipped_jinja_template_is_used_as_transformers_renders_it(tmp_path: Path) -> None:
    import transformers

    path = save_tokenizer(tmp_path / "templated")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.chat_template == TEMPLATE and not ours.chat_encoding.supports_tools
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages)
        assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.startswith(BOS_TOKEN) and text.endswith(ASSISTANT_TOKEN)
    with pytest.raises(ValueError, match="unsupported chat role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="cannot carry tools"):
        ours.apply_chat_template(CONVERSATIONS[0], tools=[{"type": "function", "function": {"name": "f"}}])


def test_the_checkpoints_own_tokenizer_json_wins(tmp_path: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    own = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    own.pre_tokenizer = pre_tokenizers.Whitespace()
    own.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 5 and tok.encode("ab b") == [0, 4, 3]


def test_decode_of_partial_utf8_does_not_crash(tok: Tokenizer) -> None:
    ids = tok.encode("🙂", add_bos=False)
    assert len(ids) > 1  # byte-level: a rare character spans several tokens
    for cut in range(1, len(ids)):
        partial = tok.decode(ids[:cut])
        assert isinstance(partial, str) and "🙂" not in partial
    assert tok.decode(ids) == "🙂"


def test_encode_and_decode_equal_the_librarys_single_input_calls(tok: Tokenizer, tok_dir: Path) -> None:
    """Tokenizer goes through the batch calls (they release the GIL); the ids and text are those of
    the library's one-input calls, long random prompts and special tokens included."""
    raw = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    rng = random.Random(7)
    prompts = [[rng.randrange(V4_VOCAB_SIZE) for _ in range(n)] for n in (1, 300, 5000)]
    for ids in prompts:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == raw.decode(ids, skip_special_tokens=skip)
    texts = [*TEXTS, raw.decode(prompts[-1], skip_special_tokens=False), BOS_TOKEN + "after bos " * 50]
    for text in texts:
        expected = raw.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_bos=False) == expected
        bos = tok.bos_token_id
        assert tok.encode(text) == (expected if expected[:1] == [bos] else [bos, *expected])


def test_tokenizer_config_names_the_fast_class_and_no_template(tok_dir: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN and "chat_template" not in cfg


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)
