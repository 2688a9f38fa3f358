"""The two-sample Kolmogorov-Smirnov test, as prompt-cache timing audits use it (scipy is not a
dependency): the statistic D = sup |F_a - F_b| and its asymptotic p-value Q(sqrt(nm / (n + m)) D),
Q being the Kolmogorov distribution's survival function (what `scipy.stats.ks_2samp(...,
method="asymp")` reports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def ks_statistic(a: Sequence[float], b: Sequence[float]) -> float:
    """sup over x of |F_a(x) - F_b(x)|, the empirical CDFs stepping at every sample (ties together)."""
    if not a or not b:
        raise ValueError("both samples need at least one value")
    xs, ys = sorted(a), sorted(b)
    n, m = len(xs), len(ys)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = min(xs[i], ys[j])
        while i < n and xs[i] <= x:
            i += 1
        while j < m and ys[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    return d


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution K (the limit of sqrt(n) D_n).

    Two series, each fast where the other is slow: for small x the Jacobi theta form
    1 - sqrt(2 pi) / x * sum_j exp(-(2j - 1)^2 pi^2 / (8 x^2)), else 2 sum_j (-1)^(j-1) exp(-2 j^2 x^2).
    """
    if x <= 0:
        return 1.0
    if x < 1.0:
        t = math.exp(-(math.pi**2) / (8 * x * x))
        s = sum(t ** ((2 * k - 1) ** 2) for k in range(1, 8))
        return max(0.0, min(1.0, 1.0 - math.sqrt(2 * math.pi) / x * s))
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return max(0.0, min(1.0, 2.0 * total))


def ks_2samp(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(D, asymptotic p-value) of the two-sample test of "a and b come from one distribution"."""
    d = ks_statistic(a, b)
    n, m = len(a), len(b)
    return d, kolmogorov_sf(math.sqrt(n * m / (n + m)) * d)
