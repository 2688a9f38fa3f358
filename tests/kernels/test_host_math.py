"""The host's launch arithmetic gives Triton's own values."""

from __future__ import annotations

import triton

from antumbra.kernels.common.host_math import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_agree_with_triton() -> None:
    for n in [*range(0, 300), 1023, 1024, 1025, 65535, 65536, 65537, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
