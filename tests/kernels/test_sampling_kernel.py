"""The Gumbel race kernel against its reference, and the reference's noise against its contract.

Runs in the Triton interpreter on CPU: vocabularies that are not multiples of the chunk, greedy
and random rows with cuts in one batch, exact ties, fully excluded rows, a column slice of a
wider row buffer (as the decode graphs pass it), the output poisoned first. The same kernel
runs inside the decode graphs on a GPU (`tests/replicas/test_gpu_paths.py` checks seeded GPU tokens
against the CPU's).
"""

from __future__ import annotations

import math

import pytest
import torch

from antumbra.kernels.sampling import (
    gumbel_reference,
    pack_rows,
    race_sample,
    race_sample_reference,
    row_keys_reference,
)
from antumbra.kernels.sampling.reference import noise_bits_reference


def _rows(n: int, temperatures: list[float], seed: int = 0) -> torch.Tensor:
    return pack_rows([seed + i for i in range(n)], [3 * i for i in range(n)], temperatures)


@pytest.mark.parametrize("vocab", [37, 4096, 9001])
def test_race_kernel_matches_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g) * 3
    temperatures = [0.0, 1.0, 0.6, 1.7, 0.0, 2.5]
    cut = torch.full((6,), float("-inf"))
    cut[2] = logits[2].topk(min(5, vocab)).values[-1]  # a top-5 row
    cut[4] = logits[4].max()  # a greedy row whose cut keeps only its best
    rows = _rows(6, temperatures)
    out = torch.full((6,), -7, dtype=torch.int64)
    got = race_sample(logits, rows, cut, out=out)
    want = race_sample_reference(logits, rows, cut)
    assert got is out and got.tolist() == want.tolist()
    assert got[0] == logits[0].argmax() and got[4] == logits[4].argmax()
    assert logits[2, got[2]] >= cut[2]


def test_ties_resolve_to_the_lowest_id_and_an_excluded_row_to_zero() -> None:
    logits = torch.zeros(3, 9000)
    logits[0, [5000, 12, 8999]] = 4.0  # greedy tie across chunks
    logits[1, [4100, 4097]] = 4.0  # greedy tie inside one chunk
    rows = _rows(3, [0.0, 0.0, 1.0])
    cut = torch.tensor([float("-inf"), float("-inf"), 1.0])  # row 2 excludes everything
    got = race_sample(logits, rows, cut)
    assert got.tolist() == [12, 4097, 0] == race_sample_reference(logits, rows, cut).tolist()


def test_a_column_slice_of_a_wider_row_buffer() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    wide = torch.zeros(4, 8, dtype=torch.int32)
    wide[:, :3] = _rows(3, [1.0, 0.5, 0.0], seed=9)
    cut = torch.full((3,), float("-inf"))
    assert (
        race_sample(logits, wide[:, :3], cut).tolist()
        == race_sample_reference(logits, wide[:, :3], cut).tolist()
    )


def test_noise_is_uniform_and_decorrelated() -> None:
    # Rows 0 / 1: two seeds at one counter; rows 2 / 3: one seed at two counters.
    rows = pack_rows([123, 124, 125, 125], [0, 0, 7, 8], [1.0] * 4)
    bits = noise_bits_reference(rows, 50_000)  # [4, V] uint32 values in int64
    u = bits.double() / 2**32
    # 64 equal bins: chi-square with 63 dof, 99.9th percentile about 103.4.
    counts = torch.histc(u.flatten(), bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 103.4
    centred = u - 0.5
    for a, b in ((centred[:, :-1], centred[:, 1:]), (centred[0], centred[1]), (centred[2], centred[3])):
        corr = float((a * b).mean() / (a.std() * b.std()))
        assert abs(corr) < 4 / math.sqrt(a.numel())  # neighbouring ids, rows, counters


def test_gumbel_noise_has_the_gumbel_moments_and_is_finite() -> None:
    g = gumbel_reference(pack_rows(list(range(8)), [0] * 8, [1.0] * 8), 20_000)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.02  # Euler-Mascheroni constant
    assert abs(float(g.std()) - math.pi / math.sqrt(6)) < 0.02


def _keys(seeds: list[int], counters: list[int]) -> list[tuple[int, int]]:
    a, b = row_keys_reference(pack_rows(seeds, counters, [1.0] * len(seeds)))
    return list(zip(a.tolist(), b.tolist(), strict=True))


def test_keys_follow_seed_and_counter_only() -> None:
    assert _keys([7], [3]) == _keys([7], [3])
    assert len(set(_keys([7] * 100, list(range(100))))) == 100
    assert len(set(_keys(list(range(100)), [0] * 100))) == 100
    # Both halves of the seed count, and seeds differing only in their high half differ.
    assert len(set(_keys([0, 1, 1 << 32, 2**64 - 1, -1], [0] * 5))) == 4  # -1 and 2**64 - 1 share bits
