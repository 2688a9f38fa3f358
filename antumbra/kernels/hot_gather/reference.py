"""The HiSparse page-in of one decode step in plain PyTorch: the definition the kernel reproduces.

Inputs, per decode row b (one request of a fixed-shape batch):
  src   [N, W]  rows of the host tier, stored format (any dtype: values, or FP8 codes + scales)
  rows  [B, K]  int32 src rows the indexer's top-k picked for row b, -1 = unused
  base  [B]     int64 first dst row of row b's hot buffer (its region holds at least K rows)
  dst   [M, W]  the hot buffers, same dtype and width as src

Selected entry j of row b is copied to dst row `base[b] + j`: the buffer is a staging area the
step fills in top-k order, so no two entries of a step share a row and no bookkeeping decides
where a row goes (the step stays free of host decisions and can be replayed from a CUDA graph).
-> slots [B, K] int32: the dst row of each entry, -1 where rows is -1 (the attention's
indirection table). `counter` ([1] int64, optional) is increased by the number of rows copied.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_rows_reference(
    src: Tensor, rows: Tensor, base: Tensor, dst: Tensor, counter: Tensor | None = None
) -> Tensor:
    k = rows.shape[1]
    slots = base[:, None].to(torch.long) + torch.arange(k, device=rows.device)[None, :]
    valid = rows >= 0
    picked = rows[valid].to(torch.long)
    dst[slots[valid].to(dst.device)] = src[picked.to(src.device)].to(dst.device)
    if counter is not None:
        counter += valid.sum()
    return torch.where(valid, slots, -1).to(torch.int32)
