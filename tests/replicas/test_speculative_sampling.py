"""The speculative rejection rule: what it emits follows the target's distribution (chi-square over
20,000 seeded draws at a fixed context), repeats itself for a seed, and is the argmax chain when greedy."""

from __future__ import annotations

import pytest
import torch

from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.speculative.rejection import sample_draft, sampling_probs, verify

DRAWS = 20_000
VOCAB = 12


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> float:
    """Pearson's test of `counts` against `probs`, over the tokens with non-zero probability."""
    support = probs > 0
    expected = probs[support].double() * draws
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def fixed_context(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits for 3 positions [3, V] and draft logits for 2 drafts [2, V], deliberately apart."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(3, VOCAB, generator=gen) * 1.5
    draft = target[:2] + torch.randn(2, VOCAB, generator=gen) * 1.5
    return target, draft


def speculate(target: torch.Tensor, draft: torch.Tensor, params: SamplingParams, seeds: list[int]):
    """Every seed drafts two tokens from `draft` and verifies them against `target` (the same
    distributions at every draw: the context is fixed). -> Verdict over len(seeds) rows."""
    n = len(seeds)
    rows = [params] * n
    d1, q1 = sample_draft(draft[0].expand(n, -1), rows, seeds, [0] * n)
    d2, q2 = sample_draft(draft[1].expand(n, -1), rows, seeds, [1] * n)
    return verify(target.expand(n, -1, -1), torch.stack([q1, q2], dim=1), torch.stack([d1, d2], dim=1),
                  rows, seeds, [0] * n)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
    ],
    ids=["plain", "top-k", "top-p", "min-p"],
)
def test_first_token_follows_the_target_distribution(params: SamplingParams) -> None:
    target, draft = fixed_context(seed=3)
    verdict = speculate(target, draft, params, list(range(DRAWS)))
    want = sampling_probs(target[:1], [params])[0]
    first = verdict.tokens[:, 0]
    counts = torch.bincount(first, minlength=VOCAB)
    assert int(counts[want == 0].sum()) == 0, "a token the cut removes was emitted"
    assert chi_square_p_value(counts, want, DRAWS) > 0.01
    # The draft is far from the target, so some drafts are rejected and some accepted: both branches ran.
    accepted = verdict.num_accepted
    assert 0 < int((accepted == 0).sum()) < DRAWS and int((accepted == 2).sum()) > 0


def test_second_token_follows_the_target_given_the_first_accepted() -> None:
    params = SamplingParams(temperature=1.0)
    target, draft = fixed_context(seed=5)
    verdict = speculate(target, draft, params, list(range(DRAWS)))
    second = verdict.tokens[verdict.num_accepted >= 1, 1]
    want = sampling_probs(target[1:2], [params])[0]
    assert second.numel() > 2000
    assert chi_square_p_value(torch.bincount(second, minlength=VOCAB), want, second.numel()) > 0.01


def test_a_wrong_distribution_is_detected() -> None:
    """The test statistic has power: the draft's own distribution is rejected as the target's."""
    params = SamplingParams(temperature=1.0)
    target, draft = fixed_context(seed=3)
    n = DRAWS
    tokens, _ = sample_draft(draft[0].expand(n, -1), [params] * n, list(range(n)), [0] * n)
    want = sampling_probs(target[:1], [params])[0]
    assert chi_square_p_value(torch.bincount(tokens, minlength=VOCAB), want, n) < 1e-6


def test_the_same_seed_repeats_and_other_seeds_differ() -> None:
    params = SamplingParams(temperature=1.0)
    target, draft = fixed_context(seed=7)
    seeds = list(range(500))
    a = speculate(target, draft, params, seeds)
    b = speculate(target, draft, params, seeds)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)
    shifted = speculate(target, draft, params, [s + 10_000 for s in seeds])
    assert not torch.equal(a.tokens, shifted.tokens)


def test_greedy_accepts_while_equal_to_the_argmax_chain() -> None:
    greedy = SamplingParams(temperature=0.0)
    target = torch.randn(4, 5, VOCAB, generator=torch.Generator().manual_seed(11))  # B=4, k=4
    best = target.argmax(dim=-1)  # [4, 5]
    drafts = best[:, :4].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % VOCAB  # row 1 rejects the first draft
    drafts[2, 2] = (drafts[2, 2] + 3) % VOCAB  # row 2 rejects the third
    q = torch.nn.functional.one_hot(drafts, VOCAB).float()
    verdict = verify(target, q, drafts, [greedy] * 4, [1, 2, 3, 4], [0, 0, 9, 0])
    assert verdict.num_accepted.tolist() == [4, 0, 2, 4]
    for row, accepted in enumerate(verdict.num_accepted.tolist()):
        emitted = verdict.tokens[row, : accepted + 1]
        assert emitted.tolist() == best[row, : accepted + 1].tolist()
        assert (verdict.tokens[row, accepted + 1 :] == -1).all()


def test_greedy_rows_decide_alike_alone_and_beside_sampled_rows() -> None:
    """An all-greedy batch takes the argmax shortcut; the same greedy rows beside a sampled row go
    through the general rule: drafts, probabilities and verdicts are the same (accepts and rejects)."""
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(4, 3, VOCAB, generator=gen)
    draft_logits = target[:, :2] + torch.randn(4, 2, VOCAB, generator=gen) * 0.8
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)
    seeds = [11, 12, 13, 14, 15]

    def run(params: list[SamplingParams], rows: int):
        t = torch.cat([target, target[:1]])[:rows]
        d = torch.cat([draft_logits, draft_logits[:1]])[:rows]
        drafts = [sample_draft(d[:, j], params, seeds[:rows], [j] * rows) for j in range(2)]
        tokens = torch.stack([x for x, _ in drafts], dim=1)
        q = torch.stack([p for _, p in drafts], dim=1)
        return tokens, q, verify(t, q, tokens, params, seeds[:rows], [0] * rows)

    alone = run([greedy] * 4, 4)
    mixed = run([greedy] * 4 + [sampled], 5)
    assert torch.equal(alone[0], mixed[0][:4])
    assert torch.equal(alone[1], mixed[1][:4])
    assert torch.equal(alone[2].tokens, mixed[2].tokens[:4])
    assert torch.equal(alone[2].num_accepted, mixed[2].num_accepted[:4])
    assert 0 < int(alone[2].num_accepted.sum()) < 8  # both branches: some drafts kept, some rejected
