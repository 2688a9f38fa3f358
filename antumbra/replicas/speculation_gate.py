"""Whether a pure decode step speculates, decided from the speeds this engine measured.

Speculation pays while verifying k + 1 positions a request costs little more than one (decode bound
by reading the weights) and the drafts are accepted; both change with the batch, the model, the device
and the text. `SpeculativeConfig.max_batch` is a fixed cap; with `gate = "measured"` this gate decides
below it too.

The algorithm. Per decode-batch bucket (B decodes rounded up to a power of two), two exponentially
weighted means of seconds per emitted token per request, each new step weighing `smoothing`: one over
the steps that speculated, one over those that did not. A step is measured by the interval from the
previous step's end to its own (the step's period, overlapped or not) and only when the previous step
was of the same bucket and kind and neither carried prompt tokens (a prompt chunk's cost is not the
decodes') nor was a speculating step without drafts. Such a step restarts the drafter after plain
steps (no request has drafts yet, so it emits one token a request at a speculating step's cost): a
sample of it would make speculating look slower than it is, most of all in the probes that are to
find out whether it still is. A step's tokens per request: 1 for a plain step; for a speculating
step the mean over its decode requests of the tokens each emitted (accepted drafts + 1; 1 for a
request without drafts).

A bucket speculates while it has no speculating mean, then decodes plainly until it has a plain mean,
then speculates when its speculating mean is at most its plain mean. So that a mean which went stale
(the text's accept rate moved) is measured again, a bucket takes the kind it is not taking for
`probe_steps` steps (at least 2: the first only starts the interval) once every `probe_every`
decisions at first. A probe costs most where it speculates: its first step has no drafts and restarts
the drafter over the tokens decoded plainly since. So while probes leave the choice as it was, the
interval between them doubles, up to `max_probe_every`; a probe that turned the choice brings it back
to `probe_every`.

Each mean ignores its bucket's first `warmup_samples` samples of its kind: the first steps of a new
batch shape capture its graphs (verify, draft cycle) or grow the allocator, and one such sample,
tens of times a step's cost, would otherwise hold the bucket on the other kind until many probes
had outweighed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass
class _Mean:
    """An exponentially weighted mean (0 weight: nothing measured)."""

    weight: float = 0.0
    total: float = 0.0
    num_to_skip: int = 0  # warm-up samples still to ignore

    def add(self, value: float, keep: float) -> None:
        if self.num_to_skip > 0:
            self.num_to_skip -= 1
            return
        self.weight = keep * self.weight + 1.0
        self.total = keep * self.total + value

    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


@dataclass
class _Bucket:
    speculating: _Mean
    plain: _Mean
    decisions: int = 0
    speculated: int = 0  # decisions that speculated
    probing: int = 0  # steps left of the current probe
    probe_interval: int = 0  # decisions from one probe's opening to the next's
    next_probe: int = 0  # the decision count at which the next probe opens
    preferred_at_probe: bool | None = None  # the choice when the last probe opened


@dataclass
class Pending:
    """The step scheduled last, until it finishes."""

    num_decodes: int
    speculated: bool
    unmeasured: bool  # it carried prompt tokens or speculated without drafts: no sample, nor the next
    num_accepted: int = 0  # drafts its verify chunks accepted

    def tokens_per_request(self) -> float:
        return (self.num_decodes + self.num_accepted) / self.num_decodes if self.num_decodes else 1.0


@dataclass(frozen=True)
class _Step:
    bucket: int
    speculated: bool
    unmeasured: bool
    end_s: float


class SpeculationGate:
    """`smoothing`: the weight of the newest step (0-1]; `probe_every` / `probe_steps`: how often and
    for how many steps a bucket takes the other kind, and `max_probe_every` how far the interval grows
    while probes confirm the choice; `warmup_samples`: the first samples of each
    bucket and kind that are ignored; `clock`: seconds. The scheduler asks `speculate`,
    then reports the step `started`, its `accepted` drafts and `finished`."""

    def __init__(self, smoothing: float = 0.1, probe_every: int = 64, probe_steps: int = 3,
                 warmup_samples: int = 2, max_probe_every: int = 1024, clock: Clock = time.monotonic) -> None:
        if (not 0 < smoothing <= 1 or probe_steps < 2 or probe_every <= probe_steps or warmup_samples < 0
                or max_probe_every < probe_every):
            raise ValueError(f"smoothing {smoothing} must be in (0, 1], probe_steps {probe_steps} >= 2, "
                             f"probe_every {probe_every} > probe_steps, max_probe_every {max_probe_every} "
                             f">= probe_every and warmup_samples {warmup_samples} >= 0")
        self.keep = 1.0 - smoothing
        self.probe_every = probe_every
        self.probe_steps = probe_steps
        self.max_probe_every = max_probe_every
        self.warmup_samples = warmup_samples
        self.clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._last: _Step | None = None
        self.pending: Pending | None = None

    def speculate(self, num_decodes: int) -> bool:
        """The decision for a step of `num_decodes` decode requests (> 0)."""
        b = self._bucket(num_decodes)
        b.decisions += 1
        decision = self._decide(b)
        b.speculated += decision
        return decision

    def _decide(self, b: _Bucket) -> bool:
        spec, plain = b.speculating.value(), b.plain.value()
        if spec is None:
            return True
        if plain is None:
            return False
        preferred = spec <= plain
        if b.probing == 0 and b.decisions >= b.next_probe:
            self._open_probe(b, preferred)
        if b.probing > 0:
            b.probing -= 1
            return not preferred
        return preferred

    def _open_probe(self, b: _Bucket, preferred: bool) -> None:
        kept = b.preferred_at_probe == preferred  # None before the first probe: never kept
        b.probe_interval = min(2 * b.probe_interval, self.max_probe_every) if kept else self.probe_every
        b.preferred_at_probe = preferred
        b.next_probe = b.decisions + b.probe_interval
        b.probing = self.probe_steps

    def started(self, num_decodes: int, speculated: bool, had_prompt: bool, drafted: bool = True) -> None:
        """A step was scheduled (a step still pending, which failed, is dropped unmeasured);
        `drafted`: a speculating step had drafts to verify (without, it is measured as neither kind)."""
        self.pending = Pending(num_decodes, speculated, had_prompt or (speculated and not drafted))

    def accepted(self, num_drafts: int) -> None:
        """The pending step's verify chunks accepted `num_drafts` drafts in all."""
        if self.pending is not None:
            self.pending.num_accepted += num_drafts

    def finished(self) -> None:
        """The pending step ended (its output applied)."""
        step, self.pending = self.pending, None
        if step is None:
            return
        now = self.clock()
        bucket = _bucket_of(step.num_decodes) if step.num_decodes > 0 else 0
        last, self._last = self._last, _Step(bucket, step.speculated, step.unmeasured, now)
        if (last is None or bucket == 0 or step.unmeasured or last.unmeasured or last.bucket != bucket
                or last.speculated != step.speculated):
            return
        b = self._bucket(step.num_decodes)
        mean = b.speculating if step.speculated else b.plain
        mean.add((now - last.end_s) / (step.tokens_per_request() if step.speculated else 1.0), self.keep)

    def means(self, num_decodes: int) -> tuple[float | None, float | None]:
        """-> (seconds per token speculating, plain) measured for the bucket of `num_decodes`."""
        b = self._bucket(num_decodes)
        return b.speculating.value(), b.plain.value()

    def summary(self) -> dict[int, dict[str, float | int | None]]:
        """Per bucket: its decisions, how many speculated, and the two means in ms per token (what a
        benchmark records to tell why the gate chose as it did)."""
        return {
            key: {"decisions": b.decisions, "speculated": b.speculated,
                  "speculating_ms_per_token": _ms(b.speculating.value()),
                  "plain_ms_per_token": _ms(b.plain.value())}
            for key, b in sorted(self._buckets.items())
        }

    def _bucket(self, num_decodes: int) -> _Bucket:
        key = _bucket_of(num_decodes)
        found = self._buckets.get(key)
        if found is None:
            found = self._buckets[key] = _Bucket(_Mean(num_to_skip=self.warmup_samples),
                                                 _Mean(num_to_skip=self.warmup_samples),
                                                 next_probe=self.probe_every)
        return found


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _bucket_of(num_decodes: int) -> int:
    """num_decodes rounded up to a power of two."""
    return 1 << max(0, num_decodes - 1).bit_length()
