"""A request's drafts: the distribution each was drawn from, kept or one-hot for a greedy draft."""

from __future__ import annotations

import torch

from antumbra.replicas.step_io import Drafts


def test_a_greedy_drafts_distributions_are_one_hot_at_its_tokens() -> None:
    drafts = Drafts((3, 1, 3), None, num_tokens=10)
    q = drafts.distributions(5, torch.device("cpu"))
    want = torch.zeros(3, 5)
    want[0, 3] = want[1, 1] = want[2, 3] = 1.0
    assert q.dtype == torch.float32 and torch.equal(q, want)


def test_drawn_drafts_keep_the_distributions_they_were_drawn_from() -> None:
    probs = torch.softmax(torch.randn(2, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert Drafts((4, 2), probs, num_tokens=3).distributions(7, torch.device("cpu")) is probs
