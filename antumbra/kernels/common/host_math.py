"""Integer helpers for launch plans on the host.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host code each call
goes through Triton's wrapper (its arguments unwrapped one by one), several microseconds where the
arithmetic takes a fraction of one, and a step's launches make hundreds of such calls. Kernel bodies
keep Triton's own (these plain functions cannot run inside `@triton.jit`).
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for integers, y > 0."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for n <= 0 (as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def split_k_slices(tiles: int, k: int, block_k: int, num_sms: int, programs_per_sm: int,
                   min_split_cols: int, forced: int = 0) -> int:
    """K slices of a launch of `tiles` output tiles over K reduction columns in `block_k` steps:
    `forced` when given, else none when the tiles fill a wave, otherwise just enough to give every
    SM `programs_per_sm` programs with at least `min_split_cols` columns a slice. Never more than
    the steps; equal slices of whole steps, none empty (a slice past K would read past its rows)."""
    steps = cdiv(k, block_k)
    if forced:
        wanted = forced
    elif tiles >= num_sms:
        wanted = 1
    else:
        wanted = min(cdiv(programs_per_sm * num_sms, tiles), k // max(min_split_cols, 1))
    wanted = min(wanted, steps)
    if wanted <= 1:
        return 1
    return cdiv(steps, cdiv(steps, wanted))
