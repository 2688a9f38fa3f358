"""Logit bias, presence / frequency / repetition penalties, min_p and the grammar-mask hook in the
batched sampler: each against probabilities written out by hand from the parameter's definition,
the race's draws against those probabilities, and reproducibility with a seed."""

from __future__ import annotations

import math

import pytest
import torch

from antumbra.replicas.penalties import TokenCounts, build_entries, with_bans
from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState
from antumbra.replicas.sampler import Sampler, SamplingRows
from antumbra.replicas.sampling_params import SamplingParams

SAMPLER = Sampler()
LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # V = 5


def _state(vocab: int = 5, eos: tuple[int, ...] = ()) -> PenaltyState:
    return PenaltyState(vocab, torch.device("cpu"), eos, max_slots=8)


def _build(params: list[SamplingParams], seeds: list[int], counts: list[int],
           histories: list[tuple[list[int], list[int]] | None],
           state: PenaltyState | None = None) -> SamplingRows:
    """Rows whose histories[i] (prompt, output) fill row i's slot (rows with equal histories and
    params share one); None: row i has no slot."""
    state = state if state is not None else _state()
    keyed = [None if h is None else PenalisedRow(f"{p}-{h}", p, h[0], h[1])
             for p, h in zip(params, histories, strict=True)]
    return SamplingRows.build(params, seeds, counts, state.rows_for(keyed))


def _rows(params: SamplingParams, prompt: list[int], output: list[int], seed: int = 0) -> SamplingRows:
    return _build([params], [seed], [len(output)], [(prompt, output)])


def _probs(params: SamplingParams, prompt: list[int] = (), output: list[int] = ()) -> torch.Tensor:
    return SAMPLER.distribution(LOGITS, _rows(params, list(prompt), list(output)))[0].double()


def _softmax(values: list[float]) -> torch.Tensor:
    e = torch.tensor([math.exp(v) if v != -math.inf else 0.0 for v in values], dtype=torch.float64)
    return e / e.sum()


def test_frequency_and_presence_penalties_follow_openai() -> None:
    # Output holds token 0 twice and token 2 once; the prompt's token 1 is not penalised.
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = _probs(params, prompt=[1, 1], output=[0, 2, 0])
    want = _softmax([2.0 - 2 * 0.5 - 0.25, 1.0, 0.5 - 0.5 - 0.25, -1.0, 0.0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_negative_penalties_encourage_repeats() -> None:
    got = _probs(SamplingParams(frequency_penalty=-2.0, presence_penalty=-2.0), output=[3])
    want = _softmax([2.0, 1.0, 0.5, -1.0 + 2.0 + 2.0, 0.0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_repetition_penalty_covers_prompt_and_output() -> None:
    # vLLM / transformers: positive logits are divided, negative ones multiplied.
    got = _probs(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[3])
    want = _softmax([2.0 / 2, 1.0, 0.5, -1.0 * 2, 0.0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_is_added_before_the_penalties() -> None:
    params = SamplingParams(logit_bias={4: 3.0, 1: -100.0}, repetition_penalty=1.5)
    got = _probs(params, prompt=[4])
    want = _softmax([2.0, 1.0 - 100.0, 0.5, -1.0, (0.0 + 3.0) / 1.5])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_steers_greedy_decoding() -> None:
    rows = _rows(SamplingParams(temperature=0.0, logit_bias={3: 3.5}), [], [])
    assert SAMPLER.sample(LOGITS, rows).token_ids == [3]
    # logprobs stay those of the model's logits (what clients compare with a reference model).
    asked = _rows(SamplingParams(temperature=0.0, logit_bias={3: 3.5}, logprobs=0), [], [])
    lp = SAMPLER.sample(LOGITS, asked)
    assert lp.logprobs[0][3] == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[3]), abs=1e-6)


def test_min_p_keeps_tokens_within_the_ratio_of_the_best() -> None:
    # At T = 0.5, p_j / p_0 = exp((l_j - 2) / 0.5): token 1 at exp(-2) = 0.135, token 2 at
    # exp(-3) = 0.050, the rest smaller. min_p 0.1 keeps tokens 0 and 1.
    got = _probs(SamplingParams(temperature=0.5, min_p=0.1))
    want = _softmax([2.0 / 0.5, 1.0 / 0.5, -math.inf, -math.inf, -math.inf])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_min_p_and_top_p_keep_the_stricter_cut() -> None:
    # Probabilities 0.563, 0.207, 0.126, 0.028, 0.076: top-p 0.9 alone keeps tokens 0, 1, 2, 4 (the
    # mass before token 4 is 0.896); min_p 0.2 keeps logits >= 2 + ln 0.2 = 0.39: tokens 0, 1, 2.
    got = _probs(SamplingParams(top_p=0.9, min_p=0.2))
    want = _softmax([2.0, 1.0, 0.5, -math.inf, -math.inf])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_min_p_applies_to_penalised_logits() -> None:
    # Token 0 drops to 0.0 by the frequency penalty: the best becomes token 1 (1.0).
    got = _probs(SamplingParams(frequency_penalty=1.0, min_p=math.exp(-0.75)), output=[0, 0])
    want = _softmax([-math.inf, 1.0, 0.5, -math.inf, -math.inf])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_allowed_token_mask_hook(packed: bool) -> None:
    allowed = torch.tensor([[False, True, False, True, False]])
    mask = torch.tensor([[(1 << 1) | (1 << 3)]], dtype=torch.int32) if packed else allowed
    rows = _rows(SamplingParams(), [], [])
    got = SAMPLER.distribution(LOGITS, rows, allowed_token_mask=mask)[0].double()
    torch.testing.assert_close(got, _softmax([-math.inf, 1.0, -math.inf, -1.0, -math.inf]), rtol=0, atol=1e-6)
    for seed in range(20):
        seeded = SamplingRows.build([SamplingParams()], [seed], [0])
        assert int(SAMPLER.sample_tokens(LOGITS, seeded, allowed_token_mask=mask)[0]) in (1, 3)


def test_draws_follow_the_adjusted_distribution() -> None:
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3,
                            logit_bias={4: 1.0}, min_p=0.05)
    prompt, output, n = [2, 3], [0, 1, 0], 4000
    rows = _build([params] * n, list(range(n)), [len(output)] * n, [(prompt, output)] * n)
    logits = LOGITS.expand(n, -1).contiguous()
    probs = SAMPLER.distribution(logits[:1], _rows(params, prompt, output))[0]
    counts = torch.bincount(SAMPLER.sample_tokens(logits, rows), minlength=5).double()
    expected = probs.double() * n
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < 20.0, (counts, expected)  # 4 degrees of freedom at most: p < 0.001 beyond ~18.5


def test_seeded_draws_are_reproducible_and_batch_independent() -> None:
    params = SamplingParams(frequency_penalty=0.4, logit_bias={2: 1.0}, min_p=0.02, seed=7)
    history = ([1], [0, 4])
    alone = _build([params], [7], [2], [history])
    plain = SamplingParams()
    mixed = _build([plain, params, plain], [1, 7, 3], [0, 2, 0], [None, history, None])
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    first = SAMPLER.sample_tokens(logits[1:2], alone)
    assert torch.equal(first, SAMPLER.sample_tokens(logits[1:2], alone))
    assert int(SAMPLER.sample_tokens(logits, mixed)[1]) == int(first[0])


def test_adjusted_rows_are_not_plain_and_need_a_slot() -> None:
    assert not _build([SamplingParams(presence_penalty=0.1)], [0], [0], [([], [])]).plain
    assert not SamplingRows.build([SamplingParams(min_p=0.1)], [0], [0]).plain
    assert SamplingRows.build([SamplingParams(min_p=0.1, temperature=0)], [0], [0]).plain
    with pytest.raises(ValueError, match="no penalty slot"):
        SamplingRows.build([SamplingParams(logit_bias={1: 1.0})], [0], [0])
    with pytest.raises(ValueError, match="no penalty slot"):
        SamplingRows.build([SamplingParams(min_tokens=2)], [0], [1])


def test_token_counts_are_incremental_and_skip_pending() -> None:
    counts = TokenCounts([5, 5, 6])
    output = [1, 2, 1]
    assert counts.update(output).counts == {1: 2, 2: 1}
    output += [2, -1]
    assert counts.update(output).counts == {1: 2, 2: 2}
    output[-1] = 3
    assert counts.update(output).counts == {1: 2, 2: 2, 3: 1}
    assert counts.prompt_ids == {5, 6}


def test_bans_merge_into_the_entries() -> None:
    params = [SamplingParams(logit_bias={2: 1.0, 9: -1.0}), SamplingParams(),
              SamplingParams(logit_bias={4: 2.0})]
    entries = build_entries(params, [TokenCounts([]), None, TokenCounts([])])
    merged = with_bans(entries, [(0, 9), (0, 5), (1, 3), (2, 4), (2, 1)])
    assert list(zip(merged.rows.tolist(), merged.tokens.tolist(), strict=True)) == [
        (0, 2), (0, 5), (0, 9), (1, 3), (2, 1), (2, 4)]
    assert merged.values[0].tolist() == [1.0, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf]
    assert merged.values[1:, 1].tolist() == [1.0, 1.0, 0.0]  # a new entry changes nothing else
    alone = with_bans(None, [(1, 7)])
    assert alone.rows.tolist() == [1] and alone.tokens.tolist() == [7] and alone.values[0, 0] == -math.inf


def test_entries_kept_between_steps_equal_entries_built_afresh() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.2,
                            logit_bias={3: 1.0, 40: -2.0})
    kept = TokenCounts([9, 3, 9, 12])
    output: list[int] = []
    for token in [5, 3, 5, 40, 77, 5, 9]:
        output.append(token)
        tokens, values = kept.update(output).entries(params)
        fresh_tokens, fresh_values = TokenCounts([9, 3, 9, 12]).update(output).entries(params)
        assert tokens.tolist() == fresh_tokens.tolist() and values.tolist() == fresh_values.tolist()
    assert tokens.tolist() == [3, 5, 9, 12, 40, 77]
    # token 5: three times in the output -> 3 * 0.5 + 0.25 subtracted, factor 1.2.
    assert values[:, 1].tolist() == [0.0, 1 / 1.2, 1.2, 1.75]
    assert values[:, 4].tolist() == [-2.0, 1 / 1.2, 1.2, 0.75]  # 40: biased, generated once


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
    ],
)
def test_sampling_params_reject_out_of_range(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    params = SamplingParams(logit_bias={7: 1.0, 2: -1.0})
    assert params.logit_bias == ((2, -1.0), (7, 1.0))
    params.validate_for(8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        params.validate_for(7)


def test_kernel_path_draws_the_reference_tokens() -> None:
    """The sampler's fused kernel path (the interpreter here) against its PyTorch path, in a batch
    mixing penalised, biased, banned, min_p, top-p and plain rows; and a sorting row with a slot,
    which takes the general path."""
    vocab = 4096 + 300
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g) * 2
    history = ([5, 9, 4200], [4200, 7, 4200, 12])
    params = [
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.3, repetition_penalty=1.4, min_p=0.05),
        SamplingParams(logit_bias={4100: 6.0, 3: -100.0}, temperature=0.7),
        SamplingParams(min_tokens=8, stop_token_ids=(11,), temperature=0.0, repetition_penalty=2.0),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.2, temperature=1.5),
        SamplingParams(),
    ]
    histories = [history if p.adjusts_logits or p.min_tokens else None for p in params]
    kernel = Sampler(use_kernel=True)
    state = _state(vocab, eos=(2,))
    for counter in range(2):
        rows = _build(params, [7 * i for i in range(6)], [counter + 3] * 6, histories, state)
        want = SAMPLER.sample_tokens(logits, rows)
        assert kernel.sample_tokens(logits, rows).tolist() == want.tolist()
    assert kernel._adjusted_workspace is not None  # the fused launches ran
    mixed = [SamplingParams(top_k=20, logit_bias={1: 1.0}), SamplingParams(min_p=0.1)]
    rows = _build(mixed, [1, 2], [0, 0], [([], []), None], state)
    got = kernel.sample_tokens(logits[:2], rows)
    assert got.tolist() == SAMPLER.sample_tokens(logits[:2], rows).tolist()
