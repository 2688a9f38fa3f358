"""Incremental detokenization with stop-string handling for streaming.

Each step decodes only a short trailing window of token ids (the prefix/read
offset scheme of HF's TextStreamer and vLLM): `decode(ids[prefix:])` minus
`decode(ids[prefix:read])` is the text the new tokens add, with the prefix
tokens there so that tokenizers whose decoding depends on the left context
(SentencePiece leading spaces, byte-level partial characters) see it.

Two kinds of text are held back from the stream until they settle:
- trailing U+FFFD from a character whose UTF-8 bytes have not all arrived;
- a suffix that could still grow into a stop string.
Everything streamed is final, so the concatenated deltas (plus `finish()`)
equal `text`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from antumbra.replicas.sampling_params import SamplingParams

# Prompt tokens decoded as left context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class StepText(NamedTuple):
    new_text: str  # text safe to stream now
    stopped: bool
    stop_reason: str | int | None  # matched stop string or stop token id


class IncrementalDetokenizer:
    """Turns one request's output tokens into streamable text deltas."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._skip_special_tokens = skip_special_tokens
        self._stop_strings = tuple(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)
        # Every proper prefix of a stop string: a text suffix in this set may still become a stop.
        self._stop_prefixes = {s[:i] for s in self._stop_strings for i in range(1, len(s))}

        # Only the prompt's tail is kept: it is all the decoding window ever looks at.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Characters of the current window already moved into _text (the window can end inside a
        # character, so its text is committed in pieces).
        self._window_chars = 0

        self._text = ""  # output text of complete characters (truncated at a stop once stopped)
        self._pending = ""  # trailing U+FFFD of a character still missing bytes
        self._emitted = 0  # length of _text already streamed
        self._num_tokens = 0
        self._stopped = False
        self._finished = False
        self._stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """The output text as it would be if the request ended now."""
        return self._text + self._pending

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def stop_reason(self) -> str | int | None:
        return self._stop_reason

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def append(self, token_id: int) -> StepText:
        """Add one generated token; returns the text that became safe to stream."""
        if self._stopped:
            # Pipelined schedulers may sample one token past a stop; it changes nothing.
            return StepText("", True, self._stop_reason)
        if self._finished:
            raise RuntimeError("append() after finish()")
        self._num_tokens += 1
        # As in the stop checks of vLLM, stops are ignored until min_tokens tokens exist.
        can_stop = self._num_tokens >= self._params.min_tokens

        if can_stop and token_id in self._params.stop_token_ids:
            if self._params.include_stop_str_in_output:
                self._ids.append(token_id)
                self._decode_new_text()
            # The request ends here, so a partial character left before the stop token is final.
            self._commit_pending()
            return self._stop(len(self._text), token_id)

        self._ids.append(token_id)
        old_len = len(self._text)
        self._decode_new_text()
        if can_stop and self._stop_strings:
            match = self._find_stop(old_len)
            if match is not None:
                end, stop = match
                cut = end if self._params.include_stop_str_in_output else end - len(stop)
                return self._stop(cut, stop)
        return StepText(self._release(len(self._text) - self._held_back()), False, None)

    def finish(self) -> str:
        """Release everything held back; call once when the request ends without a stop."""
        self._finished = True
        self._commit_pending()
        return self._release(len(self._text))

    def _decode_new_text(self) -> None:
        """Move the complete characters added by the newest token into _text."""
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        full_text = self._decode(window)
        # A shorter decode happens when e.g. a skipped special token adds nothing; wait for more.
        added = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        complete = added.rstrip(_REPLACEMENT_CHAR)
        if len(complete) > self._window_chars:
            self._text += complete[self._window_chars :]
            self._window_chars = len(complete)
        self._pending = added[self._window_chars :]
        if added and not self._pending:
            # The window ends on a character boundary: slide it so the next decode stays short.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._window_chars = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The first stop string to complete in the text added since old_len: (end index, stop).

        Matching by earliest end makes the result independent of how tokens chunk the text.
        Ties at the same end go to the longest stop string.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop_strings:
            # Only matches that end in the new text; older ones were seen (or ignored) before.
            i = self._text.find(stop, max(self._emitted, old_len - len(stop) + 1, 0))
            if i < 0:
                continue
            key = (i + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        return best[0], best[2]

    def _held_back(self) -> int:
        """Length of the longest suffix of _text that is a proper prefix of some stop string."""
        for n in range(min(self._max_stop_len - 1, len(self._text) - self._emitted), 0, -1):
            if self._text[-n:] in self._stop_prefixes:
                return n
        return 0

    def _commit_pending(self) -> None:
        self._text += self._pending
        self._pending = ""

    def _stop(self, cut: int, reason: str | int) -> StepText:
        self._text = self._text[:cut]
        self._pending = ""
        self._stopped = True
        self._stop_reason = reason
        return StepText(self._release(len(self._text)), True, reason)

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._text[self._emitted : upto]
        self._emitted = upto
        return delta
