"""Release-numerics codecs on the device: FP8 KV rows, FP4 indexer keys, activation round trips.

`layout` describes the stored rows (the definition of their bytes is `replicas/model/kv_rows.py`,
of their arithmetic `replicas/model/quant.py`, which the tests compare these kernels against);
`triton` holds the kernels. The Triton module is imported on first use so that importing this
package does not define kernels before `TRITON_INTERPRET` is set.
"""

from __future__ import annotations

from .layout import KEY_SCALE_BLOCK, KV_SCALE_BLOCK, Fp4Keys, Fp8Rows

__all__ = ["KEY_SCALE_BLOCK", "KV_SCALE_BLOCK", "Fp4Keys", "Fp8Rows"]
