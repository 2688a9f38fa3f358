"""The measured speculation gate (`speculation_gate.py`): its decisions on a fake clock, then inside
the tiny engine, where the steps' "durations" come from a fake clock that charges each kind of step
a made-up cost, and the tokens must stay those of plain decoding whichever way the gate goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from antumbra.replicas.engine import Engine
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.speculation_gate import SpeculationGate
from antumbra.rl.mtp_distill import DISTILL_SPEC, random_prompts
from tests.replicas.stepping import run_by_hand

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, logprobs=0, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def step(gate: SpeculationGate, clock: FakeClock, decodes: int, seconds: float, tokens: float = 1.0,
         plain_seconds: float | None = None, drafted: bool = True) -> bool:
    """One step as the scheduler runs it: decide, run for `seconds` (`plain_seconds` if given and it
    did not speculate), finish; -> the decision. `drafted`: a speculating step had drafts."""
    speculated = gate.speculate(decodes)
    gate.started(decodes, speculated, False, drafted=drafted)
    if speculated:
        gate.accepted(round((tokens - 1.0) * decodes))
    clock.now_s += seconds if speculated or plain_seconds is None else plain_seconds
    gate.finished()
    return speculated


def test_explores_both_kinds_then_keeps_the_faster():
    clock = FakeClock()
    gate = SpeculationGate(probe_every=1000, warmup_samples=0, clock=clock)
    # Speculating: 4 ms a step, 2.5 tokens a request (1.6 ms a token); plain: 2 ms a token.
    kinds = [step(gate, clock, 8, 4e-3, tokens=2.5) for _ in range(3)]
    assert kinds == [True, True, False]  # the second speculating step gave the first measurement
    assert not step(gate, clock, 8, 2e-3)  # the first plain one only started the interval
    spec, plain = gate.means(8)
    assert spec == pytest.approx(1.6e-3) and plain == pytest.approx(2e-3)
    assert all(step(gate, clock, 8, 4e-3, tokens=2.5) for _ in range(10))
    assert gate.means(5) == gate.means(8)  # 5-8 decodes share a bucket
    assert gate.means(9) == (None, None)


def test_a_bucket_where_speculation_is_slower_decodes_plainly():
    clock = FakeClock()
    gate = SpeculationGate(probe_every=1000, warmup_samples=0, clock=clock)
    for _ in range(2):
        step(gate, clock, 32, 12e-3, tokens=1.375)  # 8.7 ms a token
    for _ in range(2):
        step(gate, clock, 32, 3e-3)
    assert not any(step(gate, clock, 32, 3e-3) for _ in range(20))


def test_probes_the_other_kind_so_a_stale_mean_is_measured_again():
    clock = FakeClock()
    gate = SpeculationGate(smoothing=0.5, probe_every=8, probe_steps=3, warmup_samples=0, clock=clock)
    for _ in range(2):
        step(gate, clock, 1, 3e-3, tokens=1.0)  # speculation drafts nothing useful: 3 ms a token
    for _ in range(2):
        step(gate, clock, 1, 1.5e-3)
    # Now speculating takes 1 ms a token (its drafts are accepted), plain still 1.5 ms.
    decisions = [step(gate, clock, 1, 4e-3, tokens=4.0, plain_seconds=1.5e-3) for _ in range(16)]
    # Plain preferred; the bucket's 8th decision opens a 3-step probe of speculation, whose
    # measurements turn the gate to it; the 16th opens a probe of plain decoding, which stays slower.
    F, T = False, True
    assert decisions == [F, F, F, T, T, T, T, T, T, T, T, F, F, F, T, T]
    spec, plain = gate.means(1)
    assert spec is not None and plain is not None and spec < plain
    assert step(gate, clock, 1, 4e-3, tokens=4.0)


def test_probes_that_confirm_the_choice_come_ever_less_often_and_a_turn_brings_them_back():
    """Speculating at 3 ms a token against plain 1.5 ms: each probe confirms plain decoding, so the
    interval doubles (8, 16, 32, capped at 32); then speculation turns faster and the probe that
    finds it turns the gate and brings the interval back to 8."""
    clock = FakeClock()
    gate = SpeculationGate(smoothing=0.5, probe_every=8, probe_steps=3, max_probe_every=32,
                           warmup_samples=0, clock=clock)
    for _ in range(2):
        step(gate, clock, 1, 3e-3, tokens=1.0)
    for _ in range(2):
        step(gate, clock, 1, 1.5e-3)
    decisions = [step(gate, clock, 1, 3e-3, tokens=1.0, plain_seconds=1.5e-3) for _ in range(130)]
    opened = [i + 5 for i, d in enumerate(decisions) if d and (i == 0 or not decisions[i - 1])]
    assert opened == [8, 16, 32, 64, 96, 128]  # the bucket's decision counts at which probes opened
    assert sum(decisions) == 3 * len(opened)
    # Speculation now pays (1 ms a token): the next probe (decision 160) turns the gate to it.
    turned = [step(gate, clock, 1, 4e-3, tokens=4.0, plain_seconds=1.5e-3) for _ in range(60)]
    assert not any(turned[:25]) and all(turned[25:57])  # decisions 135-159 plain, 160-191 speculating
    # The probe at 192 opens with the choice turned since the last one: plain for 3 steps, and the
    # interval back to 8, so the next opens at 200.
    assert turned[57:] == [False] * 3
    assert [step(gate, clock, 1, 4e-3, tokens=4.0, plain_seconds=1.5e-3) for _ in range(8)] == \
        [True] * 5 + [False] * 3


def test_steps_with_prompt_tokens_or_after_a_change_of_kind_or_bucket_are_not_measured():
    clock = FakeClock()
    gate = SpeculationGate(warmup_samples=0, clock=clock)

    def ran(decodes: int, speculated: bool, prompt: bool, seconds: float = 1.0) -> None:
        gate.started(decodes, speculated, prompt)
        gate.accepted(decodes if speculated else 0)  # 2 tokens a request when speculating
        clock.now_s += seconds
        gate.finished()

    ran(4, True, False)
    ran(4, True, True)  # carried a prompt chunk
    ran(4, True, False)  # the one before carried a prompt chunk
    ran(16, True, False)  # another bucket
    ran(16, False, False)  # another kind
    assert gate.means(4) == (None, None) and gate.means(16) == (None, None)
    ran(16, False, False, seconds=0.5)
    assert gate.means(16) == (None, pytest.approx(0.5))
    ran(16, True, False)
    ran(16, True, False)  # 1 s for 2 tokens a request
    assert gate.means(16) == (pytest.approx(0.5), pytest.approx(0.5))
    gate.started(16, True, False)  # a step that failed: never finished, never measured
    gate.started(16, True, False)
    clock.now_s += 3.0
    gate.finished()
    assert gate.means(16)[0] == pytest.approx((0.9 * 0.5 + 3.0) / 1.9)


def test_a_buckets_first_samples_of_each_kind_are_ignored():
    """The first speculating steps of a batch shape capture its graphs: one sample of such a step,
    ten times a step's cost, would keep the bucket decoding plainly though speculating is faster."""
    decisions = {}
    for warmup in (0, 2):
        clock = FakeClock()
        gate = SpeculationGate(probe_every=1000, warmup_samples=warmup, clock=clock)
        # 4 ms a speculating step at 2 tokens a request (2 ms a token), 40 ms for the one that
        # captured; plain 3 ms a token.
        for seconds in (4e-3, 40e-3, 4e-3, 4e-3):
            if gate.means(1)[0] is None:
                assert step(gate, clock, 1, seconds, tokens=2.0)
        while gate.means(1)[1] is None:
            assert not step(gate, clock, 1, 3e-3)
        decisions[warmup] = [step(gate, clock, 1, 4e-3, tokens=2.0, plain_seconds=3e-3) for _ in range(8)]
    assert decisions == {0: [False] * 8, 2: [True] * 8}
    assert gate.means(1) == (pytest.approx(2e-3), pytest.approx(3e-3))


@pytest.mark.parametrize("kwargs", [dict(smoothing=0.0), dict(probe_steps=1),
                                    dict(probe_every=3, probe_steps=3), dict(warmup_samples=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SpeculationGate(**kwargs)


def charged_engine(path: Path, spec_step_s: float, plain_step_s: float) -> tuple[Engine, SpeculationGate]:
    """The tiny engine with the measured gate, its clock charging each step by the kind the
    scheduler chose for it."""
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", speculative_tokens=3,
                                    speculative_max_batch=16, speculative_gate="measured")
    scheduler = engine.core.scheduler
    clock = FakeClock()
    gate = SpeculationGate(probe_every=1000, warmup_samples=0, clock=clock)
    scheduler.speculation_gate = gate
    finish = scheduler.step_finished

    def charged(as_rows: bool = False) -> None:
        if gate.pending is not None:
            clock.now_s += spec_step_s if gate.pending.speculated else plain_step_s
        finish(as_rows)

    scheduler.step_finished = charged  # type: ignore[method-assign]
    return engine, gate


@pytest.mark.parametrize("speculation_pays", [True, False], ids=["speculates", "decodes_plainly"])
def test_the_engine_follows_the_gate_and_its_tokens_stay_plain_decodings(distilled_checkpoint: Path,
                                                                         speculation_pays: bool) -> None:
    batch = random_prompts(2, 16, (2, DISTILL_SPEC.padded_vocab_start), 71)
    plain = Engine.from_pretrained(distilled_checkpoint, device="cpu", dtype="float32")
    want = run_by_hand(plain, batch, GREEDY)
    # A speculating step charged at 0.9x a plain one pays whatever its drafts' fate (whether the first
    # drafts of these prompts are accepted depends on the CPU's rounding); at 20x it never does.
    spec_step_s = 0.9e-3 if speculation_pays else 20e-3
    engine, gate = charged_engine(distilled_checkpoint, spec_step_s, 1e-3)
    got = run_by_hand(engine, batch, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    spec, plain_s = gate.means(2)
    assert spec is not None and plain_s is not None
    assert (spec < plain_s) == speculation_pays
    drafted = sum(o.num_drafted_tokens for o in got)
    if speculation_pays:
        assert drafted > 3 * 10 and sum(o.num_accepted_tokens for o in got) > 0
        assert spec < spec_step_s  # per token: the accepted drafts' tokens share their steps' charge
    else:
        # The bucket of two decodes speculates until it has its measurement (a step restarting the
        # drafter, then two with drafts), then decodes plainly. A request that accepted more drafts
        # ends first, and the bucket of one decode the other reaches then measures itself the same way.
        two = gate.summary()[2]
        speculated, decisions = two["speculated"], two["decisions"]
        assert isinstance(speculated, int) and isinstance(decisions, int)
        assert 0 < speculated <= 3 and decisions - speculated >= 10 and drafted > 0


def test_the_summary_counts_each_buckets_decisions_and_reports_its_means_in_ms():
    clock = FakeClock()
    gate = SpeculationGate(probe_every=1000, warmup_samples=0, clock=clock)
    kinds = [step(gate, clock, 8, 4e-3, tokens=2.5) for _ in range(3)]
    kinds += [step(gate, clock, 8, 2e-3) for _ in range(2)]
    summary = gate.summary()
    assert list(summary) == [8]
    assert summary[8]["decisions"] == 5 and summary[8]["speculated"] == sum(kinds) == 3
    assert summary[8]["speculating_ms_per_token"] == pytest.approx(1.6)
    assert summary[8]["plain_ms_per_token"] == pytest.approx(2.0)


def test_a_speculating_step_without_drafts_is_no_sample_nor_is_the_step_after_it():
    """The drafter restarting after plain steps: a speculating step emits one token a request at a
    speculating step's cost. Counted, it would make speculating look 2.5x slower than it is here."""
    clock = FakeClock()
    gate = SpeculationGate(probe_every=1000, warmup_samples=0, clock=clock)
    assert step(gate, clock, 8, 4e-3, tokens=2.5)
    assert step(gate, clock, 8, 4e-3, drafted=False)  # no request had drafts: 4 ms a token
    assert step(gate, clock, 8, 4e-3, tokens=2.5)  # measured from a step that is no sample: none
    assert gate.means(8) == (None, None)
    assert step(gate, clock, 8, 4e-3, tokens=2.5)
    assert gate.means(8)[0] == pytest.approx(1.6e-3)
