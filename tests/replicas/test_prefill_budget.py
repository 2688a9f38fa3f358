"""The prefill bound beside decodes (`prefill_budget.py`) on a fake clock: steps "last" what a
made-up cost line says, and the bound follows from the fitted line."""

from __future__ import annotations

import pytest

from antumbra.replicas.prefill_budget import PrefillBudget

MS = 1e-3


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def run_step(budget: PrefillBudget, clock: FakeClock, decodes: int, tokens: int, seconds: float,
             as_rows: bool = False) -> None:
    budget.started(decodes, tokens)
    clock.now_s += seconds
    budget.finished(as_rows)


def test_no_bound_before_a_prefill_is_measured_or_without_decodes():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.0, floor_tokens=16, clock=clock)
    assert budget.limit(32) is None
    run_step(budget, clock, decodes=32, tokens=0, seconds=3 * MS)  # a pure decode step: no cost per token
    assert budget.limit(32) is None
    run_step(budget, clock, decodes=32, tokens=500, seconds=8 * MS)
    assert budget.limit(0) is None
    assert budget.limit(32) is not None


def test_the_bound_follows_the_fitted_line():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=16, clock=clock)
    # t = 3 ms + 0.01 ms a token at 32 decodes: (10.505 - 3) / 0.01 = 750.5: 750 tokens.
    for tokens in (0, 200, 1000, 0, 400):
        run_step(budget, clock, decodes=32, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(32) == 750
    assert budget.limit(17) == 750  # 17-32 decodes share one bucket


def test_without_spread_the_whole_step_is_charged_to_its_tokens_until_the_bound_spreads_it():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=16, clock=clock)
    cost = lambda tokens: 3 * MS + tokens * 0.01 * MS  # noqa: E731
    run_step(budget, clock, decodes=8, tokens=2000, seconds=cost(2000))
    first = budget.limit(8)
    assert first == 913  # c = 23 ms / 2000 tokens, d taken as 0: 10.505 / 0.0115 = 913.48
    run_step(budget, clock, decodes=8, tokens=first, seconds=cost(first))
    assert budget.limit(8) == 750  # two sizes: the line is exact


def test_pure_decode_steps_stay_out_of_the_line_and_a_chunk_s_fixed_cost_counts():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=16, clock=clock)
    # Pure decodes take 3 ms; any step with a chunk 5 ms plus 0.01 ms a token.
    for tokens in (0, 0, 200, 0, 1000, 0, 400):
        seconds = (5 * MS + tokens * 0.01 * MS) if tokens else 3 * MS
        run_step(budget, clock, decodes=32, tokens=tokens, seconds=seconds)
    assert budget.limit(32) == 550  # (10.505 - 5) / 0.01 = 550.5


def test_a_budget_out_of_reach_leaves_the_prefill_unbounded():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=8.6, floor_tokens=64, clock=clock)
    # A chunk's step costs 20 ms at any size: no chunk keeps the decodes within 8.6 ms.
    for tokens in (0, 100, 0, 300, 2000):
        seconds = (20 * MS + tokens * 0.0012 * MS) if tokens else 3 * MS
        run_step(budget, clock, decodes=32, tokens=tokens, seconds=seconds)
    assert budget.limit(32) is None
    # Nor when the decodes alone exceed it.
    budget = PrefillBudget(budget_ms=2.0, floor_tokens=64, clock=clock)
    for tokens in (0, 100, 300):
        run_step(budget, clock, decodes=64, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(64) is None
    # Within reach only just: the floor is the bound.
    budget = PrefillBudget(budget_ms=3.645, floor_tokens=64, clock=clock)
    for tokens in (100, 300):
        run_step(budget, clock, decodes=64, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(64) == 64


def test_a_bucket_without_prefill_borrows_the_cost_per_token_and_keeps_its_own_decode_time():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=16, clock=clock)
    for tokens in (0, 200, 1000):
        run_step(budget, clock, decodes=32, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(2) == 750  # no data at 2 decodes: the 32-decode line
    run_step(budget, clock, decodes=2, tokens=0, seconds=1.5 * MS)
    assert budget.limit(2) == 900  # (10.505 - 1.5) / 0.01, less than 901


def test_the_fit_follows_a_changed_cost():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=16, smoothing=0.5, clock=clock)
    for tokens in (200, 500) * 3:
        run_step(budget, clock, decodes=4, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(4) == 750
    for tokens in (200, 500) * 20:  # the prefill got twice as dear
        run_step(budget, clock, decodes=4, tokens=tokens, seconds=3 * MS + tokens * 0.02 * MS)
    assert budget.limit(4) == 375


def test_an_unfinished_step_is_not_measured():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.0, floor_tokens=16, clock=clock)
    budget.started(8, 100)  # this step failed: the next one is scheduled without `finished`
    clock.now_s += 1.0
    budget.started(0, 100)  # no decodes: nothing to measure
    clock.now_s += 1.0
    budget.finished()
    assert budget.limit(8) is None


def row_cost(tokens: int) -> float:
    """A step of prompt rows: 0.5 ms above the 3 ms pure decode step and 0.05 ms a token."""
    return 3.5 * MS + tokens * 0.05 * MS


def test_prompt_rows_are_tried_first_and_bounded_by_their_own_line():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=5.0, floor_tokens=256, clock=clock, row_tokens=64)
    assert budget.limit(32) == 64  # nothing measured: rows, to measure them
    for tokens in (0, 64, 0, 20, 64):
        run_step(budget, clock, decodes=32, tokens=tokens,
                 seconds=row_cost(tokens) if tokens else 3 * MS, as_rows=tokens > 0)
    assert budget.limit(32) == 30  # (5.0 - 3.5) / 0.05
    assert budget.limit(4) == 30  # another bucket borrows the line (no pure decode time of its own)
    budget.budget_s = 8.6 * MS
    assert budget.limit(32) == 64  # the line allows 102: the rows' most


def test_the_general_line_is_preferred_where_it_keeps_the_budget_and_rows_where_only_they_do():
    clock = FakeClock()
    budget = PrefillBudget(budget_ms=10.505, floor_tokens=256, clock=clock, row_tokens=64)
    for tokens in (300, 1000):  # general steps: 3 ms + 0.01 ms a token
        run_step(budget, clock, decodes=32, tokens=tokens, seconds=3 * MS + tokens * 0.01 * MS)
    assert budget.limit(32) == 750
    clock_b = FakeClock()
    budget = PrefillBudget(budget_ms=8.6, floor_tokens=256, clock=clock_b, row_tokens=64)
    for tokens in (300, 2000):  # general steps cost 20 ms at any size: out of reach
        run_step(budget, clock_b, decodes=32, tokens=tokens, seconds=20 * MS + tokens * 0.0012 * MS)
    assert budget.limit(32) == 64  # rows, not yet measured
    # A short chunk the rows could not take (it wanted every position's logits) ran on the general
    # step: measured there, it leaves the rows unmeasured.
    run_step(budget, clock_b, decodes=32, tokens=10, seconds=20 * MS)
    assert budget.limit(32) == 64
    for tokens in (64, 10):
        run_step(budget, clock_b, decodes=32, tokens=tokens, seconds=row_cost(tokens), as_rows=True)
    assert budget.limit(32) == 64
    # Rows that cannot keep the budget either (9 ms before any token): no bound.
    for tokens in (64, 10) * 30:
        run_step(budget, clock_b, decodes=32, tokens=tokens, seconds=9 * MS + tokens * 0.05 * MS,
                 as_rows=True)
    assert budget.limit(32) is None


@pytest.mark.parametrize("kwargs", [dict(budget_ms=0.0, floor_tokens=1), dict(budget_ms=5.0, floor_tokens=0),
                                    dict(budget_ms=5.0, floor_tokens=1, smoothing=0.0),
                                    dict(budget_ms=5.0, floor_tokens=1, row_tokens=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrefillBudget(**kwargs)
