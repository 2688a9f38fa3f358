"""The RL example: 30 steps of the toy loop raise the reward, with the TIS / MIS statistics logged;
and the two corrections' formulas on given ratios.

Its wall time is the example's own concern (`python -m antumbra.rl.example` prints it); this test
checks what it learns and what it reports.
"""

from __future__ import annotations

import logging

import pytest
import torch

from antumbra.rl.example import LoopConfig, make_toy_checkpoint, run
from antumbra.rl.trainer import PolicyGradientTrainer, mean


def test_thirty_steps_raise_the_toy_reward(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="antumbra.rl.example")
    history = run(make_toy_checkpoint(tmp_path / "toy"), LoopConfig(steps=30))
    first, last = mean([s.mean_reward for s in history[:5]]), mean([s.mean_reward for s in history[-5:]])
    assert last >= 2 * first and last > 0.05, (first, last)
    for stats in history:
        assert stats.num_tokens == 3 * 8 * 12
        assert 0.5 < stats.mean_ratio < 2.0  # rollout and trainer agree up to numerics
        assert 0.0 <= stats.corrected_fraction <= 1.0
    assert sum("mean_ratio" in r.message and "corrected_fraction" in r.message for r in caplog.records) == 30


@pytest.mark.parametrize(("correction", "weights", "changed"), [
    ("tis", [0.25, 0.9, 1.0, 2.0, 2.0], 1),  # min(r, 2): only the ratio above the clip changes
    ("mis", [0.0, 0.9, 1.0, 2.0, 0.0], 2),  # outside [1/2, 2] masked to 0
])
def test_the_corrections_follow_their_formulas(correction, weights, changed):
    trainer = PolicyGradientTrainer.__new__(PolicyGradientTrainer)
    trainer.clip, trainer.correction = 2.0, correction
    ratio = torch.tensor([0.25, 0.9, 1.0, 2.0, 3.5], dtype=torch.float64)
    got, count = trainer._correct(ratio)
    assert got.tolist() == weights and count == changed
