"""The checkpoint's tokenizer as llguidance sees it: every token's bytes, for masks over the vocabulary.

Built from the checkpoint's own `tokenizer.json` (what the engine tokenizes with), sized to the
model's vocabulary (padded lm_head rows are never allowed) and with the model's end-of-sequence
ids as the tokens a finished grammar allows. Building it walks the whole vocabulary (about a
second for V4's 129,280 tokens), so an engine builds it once, on the first constrained request.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from llguidance import LLTokenizer


class GrammarVocabulary:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """`tokenizer`: the engine's `Tokenizer` (its `to_json()` is the tokenizer.json text)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._built: LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> LLTokenizer:
        """The LLTokenizer, built on first use (any thread; the build drops the GIL)."""
        with self._lock:
            if self._built is None:
                self._built = LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._built
