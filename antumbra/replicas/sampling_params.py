"""Per-request decoding settings, validated once at admission.

`SamplingParams` is immutable and hashable so the scheduler can group rows that
share settings and so a request's settings cannot drift while it is running.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

MAX_LOGPROBS = 20
PENALTY_LIMIT = 2.0  # OpenAI's range for presence / frequency penalties: [-2, 2]
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias: [-100, 100]
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

    Logit adjustments, in the order the sampler applies them (`replicas/penalties.py`):
    `logit_bias` ((token id, bias) pairs; a mapping is accepted) is added; `repetition_penalty`
    (vLLM / HF: > 1 discourages) divides positive and multiplies negative logits of every token
    in the prompt or the output; `frequency_penalty` times a token's count in the output and
    `presence_penalty` once if it occurs there are subtracted (OpenAI's definitions). `min_p`
    keeps tokens whose probability is at least min_p times the most likely one's.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    # Structured output: an llguidance grammar (`replicas/structured/grammars.py` builds them from a
    # JSON schema, "any JSON object" or Lark) that every generated token must follow; the request
    # stops when the grammar is complete. None: unconstrained.
    grammar: str | None = None

    def __post_init__(self) -> None:
        # Callers (and JSON payloads) naturally pass a single string or a list; store
        # tuples so the dataclass stays hashable.
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        self._validate()
        self._validate_adjustments()

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

    def _validate_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:  # NaN fails too
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                    f"got {bias!r} for token {token}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits (bias or penalties) before it draws."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
        )

    def validate_for(self, vocab_size: int) -> None:
        """Check the settings that depend on the model's vocabulary."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t!r} is outside the vocabulary [0, {vocab_size})")
        outside = [t for t, _ in self.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})"
            )


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


def _normalise_bias(
    bias: Mapping[int, float] | Iterable[tuple[int, float]] | None,
) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, from a mapping or pairs; one entry per id."""
    if bias is None:
        return ()
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    for entry in pairs:
        try:
            token, value = entry
            if isinstance(token, bool) or isinstance(value, bool):
                raise TypeError
            token, value = operator.index(token), float(value)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map integer token ids to numbers, got {entry!r}") from None
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = value
    return tuple(sorted(out.items()))
