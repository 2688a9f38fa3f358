"""`n > 1` choices of one prompt: the prompt computed once, each choice its own seed.

A prompt with `n` choices runs as one prefill request (greedy, one token, its token dropped)
whose full pages enter the prefix cache when it finishes, then `n` choice requests queued
together: each is admitted over the cached prefix and computes only the prompt's last partial
page (the engine keeps at least one token to compute, for the logits it samples from).

Choice `i` samples with `choice_seed(seed, i)`: with a seed the choices are reproducible and
choice 0 draws exactly what the same request with n = 1 draws. `Engine.generate(n=...)` and the
platform's replica (`platform/replica/choices.py`) both derive the choices here, so an engine and
the platform give the same choices for the same seed.
"""

from __future__ import annotations

import dataclasses

from .sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd (golden ratio * 2^64): choices' seeds never coincide mod 2^64
_SEED_SPAN = 1 << 64

PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
"""The prefill request's parameters: it only computes the prompt; its one token is dropped."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed` (None stays None: every choice
    then draws its own from the engine). Choice 0 keeps the request's seed."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STRIDE) % _SEED_SPAN


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of each of the `n` choices of a request with `params`."""
    return [dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]
