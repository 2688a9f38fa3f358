"""One request's grammar state: which tokens may come next, advanced with each accepted token."""

from __future__ import annotations

from llguidance import LLMatcher, LLTokenizer

from .grammars import GrammarError


class GrammarMatcher:
    """Owned by its request (`Request.grammar`); only the engine's driver thread advances it, and
    the mask worker reads it (`masks.py`) only while the driver waits for that mask."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str) -> None:
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {self.matcher.get_error()}")

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False when the grammar does not allow it (the matcher
        is then in its error state: `error`)."""
        return self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but end of sequence)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()
