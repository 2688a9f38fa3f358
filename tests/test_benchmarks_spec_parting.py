"""Where a speculating run parts from the plain run, and whether at a tie (`spec_parting.py`)."""

from __future__ import annotations

import math
from pathlib import Path

from antumbra import Engine
from benchmarks.engine.spec_parting import (
    TIE_TOLERANCE_NATS,
    agreement,
    first_parting,
    partings,
    plain_logprobs,
)
from benchmarks.lib.api_steps import api_decode_step_ms

PROMPTS = [[3, 4, 5, 6], [7, 8, 9]]
PLAIN = [[10, 11, 12, 13], [20, 21, 22, 23]]


def _logprobs(runner_up: dict[int, float]) -> list[dict[int, float]]:
    """Four positions whose chosen token sits at log-probability -1.0, with `runner_up` at position 2."""
    return [{10: -1.0, 20: -1.0}, {11: -1.0, 21: -1.0}, {12: -1.0, 22: -1.0, **runner_up},
            {13: -1.0, 23: -1.0}]


def test_the_first_parting_is_the_first_differing_position() -> None:
    assert first_parting([1, 2, 3], [1, 2, 3]) is None
    assert first_parting([1, 2, 3], [1, 2]) is None  # equal as far as both go
    assert first_parting([1, 2, 3], [1, 5, 3]) == 1
    assert first_parting([1, 2, 3], [9, 2, 3]) == 0


def test_a_parting_is_a_tie_only_where_the_plain_run_ranks_both_tokens_within_the_tolerance() -> None:
    near = -1.0 - TIE_TOLERANCE_NATS / 2
    far = -1.0 - 4 * TIE_TOLERANCE_NATS
    got = partings(PLAIN, [_logprobs({99: near}), _logprobs({98: far})], [[10, 11, 99, 5], [20, 21, 98, 6]])
    assert [(p["request"], p["position"], p["speculating_token"]) for p in got] == [(0, 2, 99), (1, 2, 98)]
    assert math.isclose(got[0]["gap_nats"], TIE_TOLERANCE_NATS / 2) and got[0]["tie"]
    assert math.isclose(got[1]["gap_nats"], 4 * TIE_TOLERANCE_NATS) and not got[1]["tie"]
    # A token outside the plain run's top candidates has no gap and is no tie.
    outside = partings(PLAIN[:1], [_logprobs({})], [[10, 11, 77, 13]])
    assert outside == [{"request": 0, "position": 2, "plain_token": 12, "speculating_token": 77,
                        "gap_nats": None, "tie": False}]
    assert partings(PLAIN, [_logprobs({}), _logprobs({})], PLAIN) == []


def test_agreement_gates_on_ties_and_on_the_logged_run_decoding_the_timed_runs_tokens() -> None:
    references = {tuple(p): t for p, t in zip(PROMPTS, PLAIN, strict=True)}
    tie = {99: -1.0 - TIE_TOLERANCE_NATS / 2}
    logged = {tuple(p): (t, _logprobs(tie)) for p, t in zip(PROMPTS, PLAIN, strict=True)}
    assert agreement(references, logged, PROMPTS, PLAIN) == {
        "tokens_equal_plain": True, "tokens_agree": True, "partings": []}
    parted = [[10, 11, 99, 1], PLAIN[1]]
    got = agreement(references, logged, PROMPTS, parted)
    assert got["tokens_equal_plain"] is False and got["tokens_agree"] is True
    assert [p["request"] for p in got["partings"]] == [0]
    # The logged run decoded other tokens than the timed one: its log-probabilities judge nothing.
    logged[tuple(PROMPTS[0])] = ([10, 11, 12, 14], _logprobs(tie))
    assert agreement(references, logged, PROMPTS, parted)["tokens_agree"] is False


def test_the_logged_plain_run_decodes_the_timed_runs_tokens(tiny_checkpoint: Path) -> None:
    """What `agreement` relies on: asking for log-probabilities does not change the greedy tokens."""
    engine = Engine.from_pretrained(tiny_checkpoint, dtype="float32")
    prompts = [list(range(3, 40)), list(range(50, 61))]
    timed = api_decode_step_ms(engine, prompts, 6, 1, "cpu")["token_ids"]
    tokens, logprobs = plain_logprobs(engine, prompts, 6)
    assert tokens == timed
    for request_tokens, request_logprobs in zip(tokens, logprobs, strict=True):
        assert len(request_logprobs) == len(request_tokens)
        for token, ranked in zip(request_tokens, request_logprobs, strict=True):
            assert ranked[token] == max(ranked.values()) and len(ranked) >= 5
