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
