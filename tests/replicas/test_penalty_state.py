"""The device-resident penalty state (replicas/penalty_state.py): its adjustments equal the host
reference's (penalties.py: sparse entries from the request's history) bit for bit; the counts it
records on the device equal the host's count after many steps; slots are freed, reused clean,
grown, widened and evicted (then refilled from the host history) without a leak."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.sampling import adjust_slots_reference
from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState, needs_slot
from antumbra.replicas.sampler import Sampler, SamplingRows
from antumbra.replicas.sampling_params import SamplingParams
from tests.replicas.penalty_reference import host_adjusted

VOCAB = 300
EOS = (1, 2)
CPU = torch.device("cpu")


def _params(g: torch.Generator) -> SamplingParams:
    """Random params: some penalties, some biases, some min_tokens with stop ids, some nothing."""
    pick = int(torch.randint(0, 5, (1,), generator=g))
    biased = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    bias = {t: float(torch.randn(1, generator=g)) * 3 for t in biased}
    return [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, repetition_penalty=1.3, seed=1),
        SamplingParams(logit_bias=bias, repetition_penalty=0.8),
        SamplingParams(min_tokens=5, stop_token_ids=(int(torch.randint(3, VOCAB, (1,), generator=g)),),
                       presence_penalty=1.5, logit_bias={1: 4.0}),
        SamplingParams(min_tokens=3),
        SamplingParams(temperature=0.9),
    ][pick]


def _host_adjusted(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                   outputs: list[list[int]]) -> torch.Tensor:
    return host_adjusted(logits, params, prompts, outputs, EOS)


def _slot_adjusted(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    adjusted = logits.clone()
    if rows.resident is not None:
        adjust_slots_reference(adjusted, rows.packed[2].long(), rows.resident.slots.long(),
                               rows.resident.state.tables)
    return adjusted


def _step_rows(state: PenaltyState, keys: list[str], params: list[SamplingParams], prompts: list[list[int]],
               outputs: list[list[int]]) -> SamplingRows:
    rows = [PenalisedRow(k, q, p, o) if needs_slot(q, len(o)) else None
            for k, q, p, o in zip(keys, params, prompts, outputs, strict=True)]
    return SamplingRows.build(params, list(range(len(keys))), [len(o) for o in outputs], state.rows_for(rows))


def test_recorded_counts_and_adjustments_equal_the_host_reference_over_many_steps() -> None:
    g = torch.Generator().manual_seed(0)
    batch = 6
    params = [_params(g) for _ in range(batch)]
    # Negative penalties: row 0 repeats tokens, so its counts grow past 1.
    params[0] = SamplingParams(frequency_penalty=-0.7, presence_penalty=-0.4, repetition_penalty=1.3)
    prompts = [torch.randint(0, VOCAB, (30,), generator=g).tolist() for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    keys = [f"r{i}" for i in range(batch)]
    state = PenaltyState(VOCAB, CPU, EOS, max_slots=batch)
    sampler = Sampler()
    for _ in range(25):
        logits = torch.randn(batch, VOCAB, generator=g) * 2
        logits[:, :8] += 3  # a few tokens come back often, so counts grow past 1
        rows = _step_rows(state, keys, params, prompts, outputs)
        want = _host_adjusted(logits, params, prompts, outputs)
        assert torch.equal(_slot_adjusted(logits, rows), want)
        drawn = sampler.sample_tokens(logits, rows)
        state.record(drawn, rows.resident)
        for row, token in enumerate(drawn.tolist()):
            outputs[row].append(token)
        state.check_integrity(live=keys)
    for key, q, out in zip(keys, params, outputs, strict=True):
        slot = state.slot_of(key)
        if not q.adjusts_logits:
            continue
        assert slot is not None
        host = torch.bincount(torch.tensor(out), minlength=VOCAB).int()
        assert torch.equal(state.tables.counts[slot], host)
    assert max(torch.bincount(torch.tensor(outputs[0]))) > 2


def test_a_released_slot_is_reused_clean() -> None:
    state = PenaltyState(VOCAB, CPU, EOS, max_slots=4)
    first = SamplingParams(frequency_penalty=1.0, logit_bias={7: 2.0}, min_tokens=3)
    resident = state.rows_for([PenalisedRow("a", first, [5, 6], [9, 9, 10])])
    slot = int(resident.slots[0])
    state.record(torch.tensor([11]), resident)
    assert int(state.tables.counts[slot, 11]) == 1 and int(state.tables.counts[slot, 9]) == 2
    state.release("a")
    state.check_integrity(live=[])
    second = SamplingParams(presence_penalty=0.5)
    again = state.rows_for([PenalisedRow("b", second, [3], [4])])
    assert int(again.slots[0]) == slot
    counts, seen = state.tables.counts[slot], state.tables.seen[slot]
    assert counts.nonzero().flatten().tolist() == [4] and seen.nonzero().flatten().tolist() == [3, 4]
    logits = torch.zeros(1, VOCAB)
    rows = SamplingRows.build([second], [0], [1], again)
    assert torch.equal(_slot_adjusted(logits, rows), _host_adjusted(logits, [second], [[3]], [[4]]))
    state.check_integrity(live=["b"])
    with pytest.raises(AssertionError, match="finished"):
        state.check_integrity(live=[])


def test_tables_grow_and_lists_widen_keeping_what_they_hold() -> None:
    state = PenaltyState(VOCAB, CPU, EOS, max_slots=64)
    params = [SamplingParams(repetition_penalty=1.5, logit_bias={i: 1.0}) for i in range(20)]
    prompts = [[i, i + 1] for i in range(20)]
    outputs = [[i + 2] * (i % 3 + 1) for i in range(20)]
    keys = [f"k{i}" for i in range(20)]
    logits = torch.randn(20, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = _step_rows(state, keys[:5], params[:5], prompts[:5], outputs[:5])
    assert state.capacity == 8
    rows = _step_rows(state, keys, params, prompts, outputs)  # 20 slots: grown to 16, then 32
    assert state.capacity == 32
    wide = SamplingParams(logit_bias={t: 0.5 for t in range(40)}, frequency_penalty=0.2)  # past the width
    mixed = [*params, wide]
    rows = _step_rows(state, [*keys, "wide"], mixed, [*prompts, [0]], [*outputs, [3]])
    logits = torch.randn(21, VOCAB, generator=torch.Generator().manual_seed(2))
    assert torch.equal(_slot_adjusted(logits, rows), _host_adjusted(logits, mixed, [*prompts, [0]],
                                                                     [*outputs, [3]]))
    state.check_integrity(live=[*keys, "wide"])


def test_past_the_cap_a_slot_not_in_the_step_is_evicted_and_refilled_from_history() -> None:
    state = PenaltyState(VOCAB, CPU, EOS, max_slots=2)
    p = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)
    histories = {"a": ([1], [4, 4]), "b": ([2], [5]), "c": ([3], [6, 6, 6])}
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    for step_keys in (["a", "b"], ["b", "c"], ["a", "c"], ["a", "b"]):
        rows = _step_rows(state, step_keys, [p, p], [histories[k][0] for k in step_keys],
                          [histories[k][1] for k in step_keys])
        want = _host_adjusted(logits, [p, p], [histories[k][0] for k in step_keys],
                              [histories[k][1] for k in step_keys])
        assert torch.equal(_slot_adjusted(logits, rows), want)
        state.check_integrity()
    assert state.num_evictions == 3 and state.capacity == 2
    with pytest.raises(ValueError, match="exceeds the penalty state's 2 slots"):
        _step_rows(state, ["a", "b", "c"], [p] * 3, [[1], [2], [3]], [[4], [5], [6]])


def test_a_token_outside_the_vocabulary_is_refused_and_leaks_no_slot() -> None:
    state = PenaltyState(VOCAB, CPU, EOS, max_slots=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.rows_for([PenalisedRow("x", SamplingParams(logit_bias={VOCAB: 1.0}), [], [])])
    state.check_integrity(live=[])
    assert state.slot_of("x") is None
