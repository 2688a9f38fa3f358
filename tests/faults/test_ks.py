"""The KS helper against published values of the Kolmogorov distribution and hand-worked samples."""

from __future__ import annotations

import math
import random

import pytest

from tests.faults.ks import kolmogorov_sf, ks_2samp, ks_statistic


@pytest.mark.parametrize(
    ("x", "p"),
    # Critical values of the Kolmogorov distribution (Smirnov's table): P(K > x) = p.
    [(1.2238, 0.10), (1.3581, 0.05), (1.4802, 0.025), (1.6276, 0.01), (1.9495, 0.001)],
)
def test_kolmogorov_sf_matches_the_critical_values(x: float, p: float) -> None:
    assert kolmogorov_sf(x) == pytest.approx(p, rel=2e-3)


def test_both_series_agree_where_they_meet_and_the_ends_are_right() -> None:
    # scipy.stats.kstwobign.sf(0.5) and (1.0)
    assert kolmogorov_sf(0.5) == pytest.approx(0.9639452436648751, abs=1e-9)
    assert kolmogorov_sf(1.0) == pytest.approx(0.2699996716735081, abs=1e-9)
    assert kolmogorov_sf(0.999999) == pytest.approx(kolmogorov_sf(1.000001), abs=1e-5)
    assert kolmogorov_sf(0) == 1.0 and kolmogorov_sf(0.1) == pytest.approx(1.0)
    assert kolmogorov_sf(6.0) < 1e-30
    assert all(kolmogorov_sf(a / 50) >= kolmogorov_sf((a + 1) / 50) for a in range(200))  # decreasing


def test_statistic_on_hand_worked_samples() -> None:
    assert ks_statistic([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == 1.0
    assert ks_statistic([1, 3, 5, 7], [2, 4, 6, 8]) == 0.25
    assert ks_statistic([1, 1, 2], [1, 2, 2]) == pytest.approx(1 / 3)  # ties step together
    assert ks_statistic([5.0], [5.0]) == 0.0
    with pytest.raises(ValueError):
        ks_statistic([], [1.0])


def test_two_sample_p_values() -> None:
    # scipy.stats.ks_2samp(range(1, 6), range(6, 11), method="asymp"): D = 1, p = Q(sqrt(2.5))
    d, p = ks_2samp([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert d == 1.0 and p == pytest.approx(2 * (math.exp(-5) - math.exp(-20)), rel=1e-9)
    # 25 against 25, fully separated (a cache hit against a miss): far below 1e-6.
    assert ks_2samp([0.01 * i for i in range(25)], [1 + 0.01 * i for i in range(25)])[1] < 1e-9
    rng = random.Random(0)
    same = [ks_2samp([rng.gauss(0, 1) for _ in range(40)], [rng.gauss(0, 1) for _ in range(40)])[1]
            for _ in range(200)]
    # One distribution: p is about uniform, so about 5% of the runs fall under 0.05.
    assert 0.0 <= sum(p < 0.05 for p in same) / len(same) <= 0.12
    shifted = [ks_2samp([rng.gauss(0, 1) for _ in range(40)], [rng.gauss(1.5, 1) for _ in range(40)])[1]
               for _ in range(50)]
    assert max(shifted) < 1e-3
