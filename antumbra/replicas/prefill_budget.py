"""How many prefill tokens a step may carry beside its decodes, so that each decoding request's
inter-token latency stays within a budget (`SchedulerConfig.itl_budget_ms`).

The algorithm. A step of B decode rows and n > 0 prefill tokens is taken to last

    t = d_B + c_B * n  seconds,

d_B the fixed cost of such a step at that decode batch (its decodes, and whatever a step that runs a
prompt chunk costs at any chunk size), c_B the prefill cost per token beside it. Both are fitted per
decode-batch bucket (B rounded up to a power of two, as the decode graphs' batch sizes nearly are)
by least squares over the bucket's measured steps with prefill, each step weighing `smoothing`
times more than the one before it (exponentially weighted sums of 1, n, t, n*n, n*t), so the fit
follows the load and the device as they drift. Pure decode steps (n = 0) stay out of the line: a
step that runs a chunk pays a fixed cost of its own (a forward of another kind), so they are not
the line's value at 0; their mean time is kept beside it. A step is measured from `started` (once
scheduled) to `finished` (once its output is applied) by the injected clock: the time a decoding
request waits between two tokens.

While a bucket's steps with prefill all carried the same n (no spread to fit a slope from) its c is
t / n, as if d were 0: that overstates c, so the next bound is smaller, which gives the spread the
fit needs. A bucket with no measured prefill takes c from the nearest bucket that has one, and d as
its own pure decode time plus that bucket's fixed cost above its pure decode time (or that bucket's
d, while either has no pure decode step measured).

With prompt rows (`row_tokens` R > 0: a step whose prompt tokens number at most R runs wholly on the
fixed-shape decode step, each prompt token a row; `runner.py`) such steps cost another line, fitted
apart from the general one in the same way (a step is put on it when the runner says it ran as rows:
a short chunk the rows cannot take runs on the general step and is measured there): a small fixed
cost above the pure decode step and a larger cost per token. The general line is preferred wherever
it keeps the budget (it prefills the most); else the rows line gives min(R, (budget - d_B) / c_B)
tokens where at least one token keeps the budget, R while no row step is measured at any bucket;
else there is no bound.

The general bound for a step of B decode rows is

    max(floor_tokens, (budget - d_B) / c_B)   prefill tokens,

`floor_tokens` so prompts always progress, however loaded the decodes are. There is no bound with
no fit anywhere yet (no step with prefill measured), and none where even `floor_tokens` would not
keep the step within the budget (d_B + c_B * floor_tokens > budget): there a smaller chunk cannot
bring the step under the budget, it only multiplies the steps that pay the fixed cost, which
lengthens both the prompts' wait and the decodes' (so the budget then gives what no budget gives).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class _Fit:
    """Exponentially weighted sums over one bucket's steps with prefill (weight, n, t, n*n, n*t) and
    over its pure decode steps (weight, t)."""

    w: float = 0.0
    n: float = 0.0
    t: float = 0.0
    nn: float = 0.0
    nt: float = 0.0
    decode_w: float = 0.0
    decode_t: float = 0.0

    def add(self, n: float, t: float, keep: float) -> None:
        if n <= 0.0:
            self.decode_w = keep * self.decode_w + 1.0
            self.decode_t = keep * self.decode_t + t
            return
        self.w = keep * self.w + 1.0
        self.n = keep * self.n + n
        self.t = keep * self.t + t
        self.nn = keep * self.nn + n * n
        self.nt = keep * self.nt + n * t

    def decode_s(self) -> float | None:
        """The mean pure decode step, or None before one."""
        return self.decode_t / self.decode_w if self.decode_w > 0 else None

    def line(self) -> tuple[float, float] | None:
        """-> (d seconds, c seconds per token), or None before any step with prefill."""
        if self.w <= 0.0:
            return None
        mean_n, mean_t = self.n / self.w, self.t / self.w
        var = self.nn / self.w - mean_n * mean_n
        if var > 1e-9 * max(1.0, mean_n * mean_n):
            slope = (self.nt / self.w - mean_n * mean_t) / var
            if slope > 0.0:
                return max(0.0, mean_t - slope * mean_n), slope
        return 0.0, mean_t / mean_n  # no spread (or noise): all of t charged to the tokens


class PrefillBudget:
    """`budget_ms`: the inter-token latency a step of decodes should keep to; `floor_tokens`: the
    least prefill a general step with decodes carries; `smoothing`: the weight of the newest step
    (0-1]; `row_tokens`: the most prompt tokens a step runs as fixed-shape rows (0: none)."""

    def __init__(self, budget_ms: float, floor_tokens: int, smoothing: float = 0.1,
                 clock: Clock = time.monotonic, row_tokens: int = 0) -> None:
        if budget_ms <= 0 or floor_tokens < 1 or not 0 < smoothing <= 1 or row_tokens < 0:
            raise ValueError(f"budget_ms {budget_ms} must be > 0, floor_tokens {floor_tokens} >= 1, "
                             f"smoothing {smoothing} in (0, 1], row_tokens {row_tokens} >= 0")
        self.budget_s = budget_ms / 1e3
        self.floor_tokens = floor_tokens
        self.row_tokens = row_tokens
        self.keep = 1.0 - smoothing
        self.clock = clock
        # One fit per (kind, bucket): kind True for steps of prompt rows (their pure decode steps
        # are kept under False).
        self._fits: dict[tuple[bool, int], _Fit] = {}
        self._open: tuple[int, int, float] | None = None  # (bucket, prefill tokens, start) of a step

    def limit(self, num_decodes: int) -> int | None:
        """The most prefill tokens a step with `num_decodes` decode rows may carry; None: no bound
        (no decodes, nothing measured yet, or nothing keeps the budget)."""
        if num_decodes <= 0:
            return None
        bucket = _bucket(num_decodes)
        general = self._line(False, bucket)
        if general is not None:
            d, c = general
            if d + c * self.floor_tokens <= self.budget_s:
                return max(self.floor_tokens, math.floor((self.budget_s - d) / c))
        if self.row_tokens <= 0:
            return None  # out of reach at any chunk size: smaller chunks only add fixed costs
        rows = self._line(True, bucket)
        if rows is None:
            return self.row_tokens
        d, c = rows
        if d + c > self.budget_s:
            return None
        return min(self.row_tokens, math.floor((self.budget_s - d) / c))

    def started(self, num_decodes: int, prefill_tokens: int) -> None:
        """A step was scheduled (a step still open, which failed, is dropped unmeasured)."""
        self._open = (_bucket(num_decodes), prefill_tokens, self.clock()) if num_decodes > 0 else None

    def finished(self, as_rows: bool = False) -> None:
        """The step scheduled last has run and its output is applied; `as_rows`: its prompt tokens
        ran as fixed-shape rows (a step the rows could not take, one wanting every position's
        logits say, ran on the general step and is measured on that line)."""
        if self._open is None:
            return
        bucket, tokens, start = self._open
        self._open = None
        rows = as_rows and tokens > 0
        self._fits.setdefault((rows, bucket), _Fit()).add(float(tokens), self.clock() - start, self.keep)

    def _line(self, rows: bool, bucket: int) -> tuple[float, float] | None:
        own = self._fits.get((rows, bucket))
        line = own.line() if own is not None else None
        if line is not None:
            return line
        # The nearest bucket with a fit of this kind (the smaller one first on a tie) gives c, and
        # the fixed cost such a step adds to a step, on top of this bucket's own pure decode time.
        known = sorted((abs(b.bit_length() - bucket.bit_length()), b) for (kind, b), f in self._fits.items()
                       if kind == rows and f.line() is not None)
        if not known:
            return None
        near_bucket = known[0][1]
        near = self._fits[(rows, near_bucket)].line()
        assert near is not None
        own_decode = self._decode_s(bucket)
        near_decode = self._decode_s(near_bucket)
        if own_decode is None or near_decode is None:
            return near
        return own_decode + max(0.0, near[0] - near_decode), near[1]

    def _decode_s(self, bucket: int) -> float | None:
        fit = self._fits.get((False, bucket))
        return fit.decode_s() if fit is not None else None


def _bucket(num_decodes: int) -> int:
    """num_decodes rounded up to a power of two."""
    return 1 << max(0, num_decodes - 1).bit_length()
