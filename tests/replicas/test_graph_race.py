"""The decode graphs' race (replicas/graph_race.py) on the CPU, its kernels interpreted: it draws the
sampler's tokens for penalised, min_p and plain rows, counts a final draw once into the slots (and
nothing for a draw that is not final, padded rows or a warm-up), counts a late (masked) draw from
its own slots, and reports its tables stale once a list widened them."""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.sampling import race_sample_reference
from antumbra.replicas.graph_race import GraphRace
from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState
from antumbra.replicas.sampler import Sampler, SamplingRows
from antumbra.replicas.sampling_params import SamplingParams

VOCAB = 300
CPU = torch.device("cpu")
PARAMS = [SamplingParams(frequency_penalty=-1.0, repetition_penalty=1.3, logit_bias={4: 2.0}, seed=1),
          SamplingParams(min_p=0.1, seed=2), SamplingParams(seed=3),
          SamplingParams(temperature=0.0, min_tokens=5, presence_penalty=0.5)]


def _setup() -> tuple[PenaltyState, GraphRace, SamplingRows]:
    state = PenaltyState(VOCAB, CPU, (1,), max_slots=4)
    race = GraphRace(6, VOCAB, CPU, state, use_graphs=False)
    resident = state.rows_for([PenalisedRow("a", PARAMS[0], [7, 8], [9, 9]), None, None,
                               PenalisedRow("d", PARAMS[3], [3], [])])
    return state, race, SamplingRows.build(PARAMS, [11, 12, 13, 14], [2, 0, 0, 0], resident)


def test_a_final_draw_equals_the_sampler_and_is_counted_once() -> None:
    state, race, rows = _setup()
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    before = state.tables.counts.clone()
    assert race.draws(rows)
    race.stage(rows, 4, final=True)
    race.race(logits, 6)  # padded rows 4 and 5 draw too, into no slot
    drawn = race.tokens[:4]
    assert drawn.tolist() == Sampler().sample_tokens(logits[:4], rows).tolist()
    added = state.tables.counts - before
    slot_a, slot_d = (int(s) for s in rows.resident.slots[[0, 3]])
    assert added[slot_a].nonzero().flatten().tolist() == [int(drawn[0])]
    assert added[slot_d].nonzero().flatten().tolist() == [int(drawn[3])]
    assert int(added[: state.capacity].sum()) == 2  # the scratch row takes the others
    plain = SamplingRows.build([PARAMS[2]], [13], [0])
    alone = race_sample_reference(logits[2:3], plain.packed, torch.full((1,), -torch.inf))
    assert int(drawn[2]) == int(alone[0])


def test_a_draw_that_is_not_final_counts_nothing_and_a_late_one_counts() -> None:
    state, race, rows = _setup()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    before = state.tables.counts.clone()
    race.stage(rows, 4, final=False)
    race.race(logits, 4)
    saved = race.blank()
    race.race(logits, 4, late=True)  # a warm-up: the slots are blank
    assert torch.equal(state.tables.counts[: state.capacity], before[: state.capacity])
    race.restore(saved)
    race.race(logits, 4, late=True)
    assert int((state.tables.counts - before)[: state.capacity].sum()) == 2


def test_tables_moved_by_a_widened_list_are_stale() -> None:
    state, race, rows = _setup()
    race.stage(rows, 4, final=True)
    race.race(torch.zeros(4, VOCAB), 4)
    assert not race.stale()
    wide = SamplingParams(logit_bias={t: 1.0 for t in range(40)})
    state.rows_for([PenalisedRow("wide", wide, [], [])])
    assert race.stale()


def test_rows_drawn_at_chosen_positions_equal_the_sampler_and_count_nothing() -> None:
    """A prompt rows step: the sampling rows sit at their chunks' last rows (`stage_at`)."""
    state, race, _ = _setup()
    plain = [SamplingParams(seed=3), SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, seed=5)]
    rows = SamplingRows.build(plain, [13, 14, 15], [0, 4, 2])
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    before = state.tables.counts.clone()
    at = [1, 2, 5]
    race.stage_at(rows, at, 6)
    race.race(logits, 6)
    assert race.tokens[at].tolist() == Sampler().sample_tokens(logits[at], rows).tolist()
    assert torch.equal(state.tables.counts[: state.capacity], before[: state.capacity])  # scratch row aside
    _, _, penalised = _setup()
    with pytest.raises(ValueError, match="plain rows without penalty slots or min_p"):
        race.stage_at(penalised, [0, 1, 2, 3], 6)
    with pytest.raises(ValueError, match="positions"):
        rows.spread([0, 1], 6)
