"""Streaming detokenization against a real byte-level BPE tokenizer (one token per byte)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from antumbra.replicas.detokenizer import IncrementalDetokenizer, StepText
from antumbra.replicas.sampling_params import SamplingParams

EOS = "<eos>"


def _byte_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


TOK = _byte_tokenizer()
EOS_ID = TOK.token_to_id(EOS)
PROMPT = TOK.encode("Q: say something\nA:").ids


def _ids(text: str) -> list[int]:
    return TOK.encode(text).ids


def _stream(
    token_ids: list[int], params: SamplingParams, prompt: list[int] | None = None
) -> tuple[list[StepText], str, IncrementalDetokenizer]:
    """Feed tokens until a stop; returns the steps, the concatenated stream, and the detokenizer."""
    detok = IncrementalDetokenizer(TOK, PROMPT if prompt is None else prompt, params)
    steps = []
    for t in token_ids:
        steps.append(detok.append(t))
        if steps[-1].stopped:
            break
    streamed = "".join(s.new_text for s in steps) + detok.finish()
    return steps, streamed, detok


def _reference(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """The first stop to complete (earliest end, longest on ties) and the truncated text."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    if best is None:
        return text, None
    _, i, s = best
    return text[: i + len(s)] if include else text[:i], s


def test_tokenizer_is_one_token_per_byte() -> None:
    text = "héllo 世界 🙂"
    assert len(_ids(text)) == len(text.encode())
    assert TOK.decode(_ids(text)[:2]).endswith("\ufffd")


def test_multibyte_utf8_never_streams_replacement_char() -> None:
    text = "héllo 世界 🙂 ok"
    steps, streamed, detok = _stream(_ids(text), SamplingParams())
    assert all("\ufffd" not in s.new_text for s in steps)
    assert streamed == text == detok.text == TOK.decode(_ids(text))
    assert not any(s.stopped for s in steps)
    # The emoji's four bytes produce nothing until the last one arrives.
    emoji_start = len("héllo 世界 ".encode())
    assert [s.new_text for s in steps[emoji_start : emoji_start + 4]] == ["", "", "", "🙂"]


def test_text_before_finish_shows_incomplete_character() -> None:
    ids = _ids("a世")
    detok = IncrementalDetokenizer(TOK, PROMPT, SamplingParams())
    assert detok.append(ids[0]).new_text == "a"
    assert detok.append(ids[1]).new_text == ""
    assert detok.text == "a\ufffd"
    # A request ending mid-character (max_tokens) reports what the tokenizer decodes.
    assert detok.finish() == "\ufffd"
    with pytest.raises(RuntimeError):
        detok.append(ids[2])


def test_prompt_ending_mid_character_does_not_leak_into_output() -> None:
    prompt = _ids("prompt é")[:-1]
    _, streamed, _ = _stream(_ids("hi"), SamplingParams(), prompt=prompt)
    assert streamed == "hi"


def test_stop_string_spanning_tokens_truncates() -> None:
    steps, streamed, detok = _stream(_ids("Hello, 世界! More text"), SamplingParams(stop=["世界"]))
    assert steps[-1].stopped and steps[-1].stop_reason == "世界"
    assert streamed == detok.text == "Hello, "
    # Stops as soon as the last byte of the stop string arrives.
    assert len(steps) == len("Hello, 世界".encode())


def test_include_stop_str_in_output() -> None:
    params = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    steps, streamed, detok = _stream(_ids("abc END def"), params)
    assert streamed == detok.text == "abc END"
    assert steps[-1].stop_reason == "END"


def test_held_back_prefix_is_released_when_not_a_stop() -> None:
    params = SamplingParams(stop=["</s>"])
    detok = IncrementalDetokenizer(TOK, PROMPT, params)
    deltas = [detok.append(t).new_text for t in _ids("a</b")]
    assert deltas == ["a", "", "", "</b"]
    assert detok.text == "a</b"


def test_held_back_prefix_released_on_finish() -> None:
    steps, streamed, detok = _stream(_ids("x</"), SamplingParams(stop=["</s>"]))
    assert "".join(s.new_text for s in steps) == "x"
    assert streamed == detok.text == "x</"


def test_earliest_completed_stop_wins() -> None:
    steps, streamed, _ = _stream(_ids("xxabcdyy"), SamplingParams(stop=["abcd", "bc"]))
    assert steps[-1].stop_reason == "bc"
    assert streamed == "xxa"


def test_stop_token_id_excludes_its_text() -> None:
    stop_id = _ids("!")[0]
    steps, streamed, detok = _stream(_ids("hi! there"), SamplingParams(stop_token_ids=[stop_id]))
    assert steps[-1] == StepText("", True, stop_id)
    assert streamed == detok.text == "hi"
    assert detok.append(_ids("x")[0]) == StepText("", True, stop_id)


def test_stop_token_id_releases_held_stop_prefix() -> None:
    params = SamplingParams(stop=["###"], stop_token_ids=[EOS_ID])
    steps, streamed, _ = _stream([*_ids("ok ##"), EOS_ID], params)
    assert steps[-1].stopped and steps[-1].stop_reason == EOS_ID
    assert steps[-1].new_text == "##"
    assert streamed == "ok ##"


def test_stop_token_id_with_include_stop_str_in_output() -> None:
    stop_id = _ids("!")[0]
    params = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True)
    _, streamed, _ = _stream(_ids("hi! there"), params)
    assert streamed == "hi!"


def test_special_tokens_are_skipped() -> None:
    _, streamed, _ = _stream([*_ids("a"), EOS_ID, *_ids("b")], SamplingParams())
    assert streamed == "ab"


def test_min_tokens_defers_stops() -> None:
    params = SamplingParams(stop=["x"], min_tokens=3, max_tokens=10)
    steps, streamed, _ = _stream(_ids("axbxcx"), params)
    # The first "x" is token 2 < min_tokens; the second (token 4) stops.
    assert streamed == "axb"
    assert steps[-1].stop_reason == "x"


STOP_ALPHABET = "ab é世🙂"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=STOP_ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_stream_equals_final_text_property(text: str, stops: list[str], include: bool) -> None:
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=200)
    steps, streamed, detok = _stream(_ids(text), params)
    assert streamed == detok.text
    assert all("\ufffd" not in s.new_text for s in steps)
    expected, reason = _reference(text, params.stop, include)
    assert detok.text == expected
    assert detok.stop_reason == reason
    if not include:
        assert not any(s in detok.text for s in stops)


class _ChunkTokenizer:
    """Each id names an arbitrary byte chunk, so tokens can start or end inside a character."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.window_sizes: list[int] = []

    def add(self, chunk: bytes) -> int:
        self.chunks.append(chunk)
        return len(self.chunks) - 1

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return b"".join(self.chunks[i] for i in ids).decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=STOP_ALPHABET, max_size=20),
    cuts=st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40),
    stops=st.lists(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=3), max_size=2),
)
def test_tokens_straddling_characters_property(text: str, cuts: list[int], stops: list[str]) -> None:
    tok = _ChunkTokenizer()
    data = text.encode()
    ids, pos, k = [], 0, 0
    while pos < len(data):
        size = cuts[k % len(cuts)]
        ids.append(tok.add(data[pos : pos + size]))
        pos, k = pos + size, k + 1
    params = SamplingParams(stop=stops)
    detok = IncrementalDetokenizer(tok, [], params)
    steps = []
    for t in ids:
        steps.append(detok.append(t))
        if steps[-1].stopped:
            break
    streamed = "".join(s.new_text for s in steps) + detok.finish()
    assert all("\ufffd" not in s.new_text for s in steps)
    assert streamed == detok.text == _reference(text, params.stop, False)[0]


def test_decode_window_stays_short() -> None:
    tok = _ChunkTokenizer()
    ids = [tok.add(ch.encode()) for ch in "abc 世界 🙂 " * 300]
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    streamed = "".join(detok.append(t).new_text for t in ids)
    assert streamed == "abc 世界 🙂 " * 300
    assert max(tok.window_sizes) <= 3
