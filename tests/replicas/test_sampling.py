"""SamplingParams validation and the batched Sampler's semantics (the PyTorch race; the Triton
kernel is checked against it in tests/kernels/test_sampling_kernel.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState, needs_slot
from antumbra.replicas.sampler import Sampler, SamplerOutput, SamplingRows
from antumbra.replicas.sampling_params import SamplingParams

SAMPLER = Sampler()


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # The tensors here are tiny: intra-op threads only add synchronisation, which costs
    # milliseconds per op on a busy CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int] | None = None,
    counts: list[int] | None = None,
    eos: tuple[int, ...] = (),
) -> SamplerOutput:
    batch = logits.shape[0]
    counts = counts if counts is not None else [0] * batch
    state = PenaltyState(logits.shape[1], logits.device, eos, max_slots=max(batch, 1))
    resident = state.rows_for([PenalisedRow(str(i), p, (), ()) if needs_slot(p, c) else None
                               for i, (p, c) in enumerate(zip(params, counts, strict=True))])
    rows = SamplingRows.build(params, seeds if seeds is not None else list(range(batch)), counts, resident)
    return SAMPLER.sample(logits, rows)


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """Token counts over n rows of the same logits, each row with its own seed."""
    out = _sample(logits_row.expand(n, -1).contiguous(), [params] * n, [seed * 100_003 + i for i in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[0])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token with zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# -- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name", "value"),
    [
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": math.inf}, "temperature", "inf"),
        ({"temperature": math.nan}, "temperature", "nan"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"logprobs": 21}, "logprobs", "21"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens", "17"),
        ({"stop": ["ok", ""]}, "stop", "''"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "-3"),
        ({"seed": 2**64}, "seed", str(2**64)),
    ],
)
def test_invalid_params_raise_naming_the_parameter(kwargs: dict, name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**kwargs)
    assert value in str(info.value)


def test_params_normalise_stop_and_are_hashable() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",)
    assert p.stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(p) == hash(SamplingParams(stop=("END",), stop_token_ids=(3, 4)))
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(temperature=0).greedy


def test_validate_for_checks_stop_token_range() -> None:
    p = SamplingParams(stop_token_ids=[5, 10])
    p.validate_for(11)
    with pytest.raises(ValueError, match=r"stop_token_ids.*10"):
        p.validate_for(10)


# -- greedy ------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.randn(6, 50, generator=_gen(0))
    logits[2, 7] = logits[2, 30] = 100.0
    out = _sample(logits, [SamplingParams(temperature=0)] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert out.logprobs == [None] * 6


# -- seeded reproducibility ---------------------------------------------------------------------------


def _seeded_run(batch_logits: torch.Tensor, params: list[SamplingParams], row: int, seed: int) -> list[int]:
    """Tokens row `row` gets over 30 steps (its token counter advancing) when its seed is `seed`;
    the other rows have other seeds and counters."""
    tokens = []
    for step in range(30):
        seeds = [1000 + i for i in range(len(params))]
        counts = [step + 3 * i for i in range(len(params))]
        seeds[row], counts[row] = seed, step
        tokens.append(_sample(batch_logits, params, seeds, counts).token_ids[row])
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batch() -> None:
    target = torch.randn(1, 64, generator=_gen(1)) * 0.5  # flat enough that draws vary
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=7)
    alone = _seeded_run(target, [params], row=0, seed=7)
    assert alone == _seeded_run(target, [params], row=0, seed=7)
    assert len(set(alone)) > 5

    others = torch.randn(5, 64, generator=_gen(2))
    mixed_params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(),
        SamplingParams(top_k=3, seed=99),
        SamplingParams(temperature=2.0, min_tokens=4),
    ]
    for row in (0, 3, 5):
        batch = torch.cat([others[:row], target, others[row:]])
        batch_params = [*mixed_params[:row], params, *mixed_params[row:]]
        assert _seeded_run(batch, batch_params, row=row, seed=7) == alone
    assert _seeded_run(target, [params], row=0, seed=8) != alone


def test_plain_rows_are_those_without_cut_or_ban() -> None:
    plain = SamplingRows.build([SamplingParams(), SamplingParams(temperature=0, top_k=3)], [1, 2], [0, 0])
    assert plain.plain  # a greedy row's top-k changes nothing
    assert not SamplingRows.build([SamplingParams(top_p=0.9)], [1], [0]).plain
    state = PenaltyState(10, torch.device("cpu"), (), max_slots=1)
    short = state.rows_for([PenalisedRow("a", SamplingParams(min_tokens=2), (), ())])
    assert not SamplingRows.build([SamplingParams(min_tokens=2)], [1], [1], short).plain
    assert SamplingRows.build([SamplingParams(min_tokens=2)], [1], [2]).plain


# -- filters -------------------------------------------------------------------------------------------


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(16, 100, generator=_gen(3)) * 3
    greedy = _sample(logits, [SamplingParams(temperature=0)] * 16).token_ids
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        for seed in range(5):
            assert _sample(logits, [params] * 16, [seed * 100 + i for i in range(16)]).token_ids == greedy


def test_top_k_restricts_support_to_k_best() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]])
    counts = _draws(logits[0], SamplingParams(top_k=3), n=2000, seed=4)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2, 3}
    renormalised = torch.softmax(logits[0, [1, 2, 3]], dim=-1)
    assert _chi_square(counts[[1, 2, 3]], renormalised) < 20


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 + 0.3 reaches top_p=0.79, so exactly the first two tokens survive (thresholds sit off
    # the exact cumulative sums, which fp32 rounding makes ambiguous).
    counts = _draws(logits, SamplingParams(top_p=0.79), n=2000, seed=5)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1}
    # Just above 0.8 needs the third token too.
    counts = _draws(logits, SamplingParams(top_p=0.81), n=2000, seed=5)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1, 2}


# -- distributions ---------------------------------------------------------------------------------------

# 99.9th percentile of chi-square with 7 degrees of freedom is 24.3. The draws are seeded, so
# these tests are deterministic; the bound is what a correct sampler passes for almost any seed.
CHI2_7DOF_999 = 24.3
DIST_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])


def test_temperature_one_matches_softmax() -> None:
    counts = _draws(DIST_LOGITS, SamplingParams(), n=20000, seed=6)
    assert _chi_square(counts, torch.softmax(DIST_LOGITS, dim=-1)) < CHI2_7DOF_999


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_distribution(temperature: float) -> None:
    counts = _draws(DIST_LOGITS, SamplingParams(temperature=temperature), n=20000, seed=7)
    assert _chi_square(counts, torch.softmax(DIST_LOGITS / temperature, dim=-1)) < CHI2_7DOF_999
    # And is clearly not the temperature-1 distribution.
    assert _chi_square(counts, torch.softmax(DIST_LOGITS, dim=-1)) > 200


def test_lower_temperature_concentrates_mass() -> None:
    top = int(DIST_LOGITS.argmax())
    shares = [
        _draws(DIST_LOGITS, SamplingParams(temperature=t), n=2000, seed=8)[top] / 2000
        for t in (2.0, 1.0, 0.3)
    ]
    assert shares[0] < shares[1] < shares[2]


# -- logprobs ----------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_chosen_and_top_n() -> None:
    logits = torch.randn(4, 200, generator=_gen(9)) * 4
    params = [
        SamplingParams(temperature=0.6, top_k=5, logprobs=5),  # processing must not leak into logprobs
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=2.0, top_p=0.9, logprobs=20),
    ]
    out = _sample(logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    for row, p in enumerate(params):
        entry = out.logprobs[row]
        if p.logprobs is None:
            assert entry is None
            continue
        assert entry is not None
        chosen = out.token_ids[row]
        top = reference[row].topk(p.logprobs).indices.tolist() if p.logprobs else []
        assert set(entry) == {chosen, *top}
        for token, lp in entry.items():
            assert lp == pytest.approx(float(reference[row, token]), abs=1e-5)


def test_logprobs_include_chosen_token_outside_top_n() -> None:
    # Flat logits with top_k off: a seeded draw lands outside the top-1 almost surely.
    logits = torch.zeros(1, 1000)
    logits[0, 0] = 0.1
    out = _sample(logits, [SamplingParams(logprobs=1)], [0])
    chosen = out.token_ids[0]
    assert chosen != 0
    assert set(out.logprobs[0]) == {0, chosen}


def test_logprobs_ignore_min_tokens_mask() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    out = _sample(logits, [SamplingParams(temperature=0, min_tokens=2, logprobs=1)], counts=[0], eos=(0,))
    assert out.token_ids == [1]
    assert out.logprobs[0][0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 0]))


# -- min_tokens ----------------------------------------------------------------------------------------------


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    eos, stop = 0, 1
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.5]]).repeat(3, 1)
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]),
    ]
    for step in range(20):
        out = _sample(logits, params, [0, step, 0], counts=[0, 2, 3], eos=(eos,))
        assert out.token_ids[0] == 2
        assert out.token_ids[1] in (2, 3)
        assert out.token_ids[2] == eos  # min_tokens reached: EOS allowed again


def test_empty_batch_and_shape_errors() -> None:
    assert _sample(torch.zeros(0, 10), []) == SamplerOutput([], [])
    one = SamplingRows.build([SamplingParams()], [0], [0])
    with pytest.raises(ValueError, match="params"):
        SAMPLER.sample(torch.zeros(2, 10), one)
    with pytest.raises(ValueError, match="logits"):
        SAMPLER.sample(torch.zeros(10), one)
    with pytest.raises(ValueError, match="seeds"):
        SamplingRows.build([SamplingParams()], [0, 1], [0])
