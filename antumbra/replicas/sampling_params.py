"""Per-request decoding settings, validated once at admission.

`SamplingParams` is immutable and hashable so the scheduler can group rows that
share settings and so a request's settings cannot drift while it is running.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20
# The range torch.Generator.manual_seed accepts; rejecting other seeds here keeps a bad
# request from failing later inside the batched sampling step.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy decoding; `top_k` of 0 or -1 disables top-k;
    `logprobs = N` returns the chosen token's logprob plus the top-N alternatives
    (0 = only the chosen token, None = none).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # R3: report the experts every MoE layer chose for each token the model read (`RequestOutput.
    # routed_experts`); such a request computes its whole prompt (cached pages hold no routing).
    return_routed_experts: bool = False
    # Structured output: an llguidance grammar (`replicas/structured/grammars.py` builds them from a
    # JSON schema, "any JSON object" or Lark) that every generated token must follow; the request
    # stops when the grammar is complete. None: unconstrained.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Callers (and JSON payloads) naturally pass a single string or a list; store
        # tuples so the dataclass stays hashable.
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_ids(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        for s in self.stop:
            if not s:
                raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be non-negative, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate_for(self, vocab_size: int) -> None:
        """Check the settings that depend on the model's vocabulary."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t!r} is outside the vocabulary [0, {vocab_size})")


def _normalise_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    out = tuple(stop)
    for s in out:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got element {s!r}")
    return out


def _normalise_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    out = []
    for t in ids:
        # operator.index accepts numpy/torch integer scalars but rejects floats.
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"stop_token_ids must be integers, got element {t!r}") from None
    return tuple(out)
