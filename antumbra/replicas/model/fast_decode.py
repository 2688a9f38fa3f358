"""The fixed-shape decode step: one token per row, every index built on the device.

`DeepseekV4.forward` serves any mix of prefill chunks and decodes, but it sizes tensors from the
data (the longest sequence, the windows that close this step) and so waits for the device. This
step takes a decode batch padded to a fixed size and fixed widths (`DecodeShape`), builds its index
on the device (`decode_index.py`) and runs the same layers over it with the Triton kernels, so a
step never leaves the device and can be captured once per batch size in a CUDA graph and replayed.
No step waits for the host, HiSparse decodes included (`fixed_attention.py` pages their rows in).
"""

from __future__ import annotations

import torch

from antumbra.cachestore.pools import KVPools

from .decode_index import DecodeInputs, DecodeShape, build_decode_index
from .model import DeepseekV4


@torch.no_grad()
def decode_step(
    model: DeepseekV4,
    inp: DecodeInputs,
    pools: KVPools,
    shape: DecodeShape,
    probe: torch.Tensor | None = None,
    side: torch.cuda.Stream | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row -> (logits [B, V] float32, the last layer's streams [B, n, D] in the
    model dtype, what the MTP drafter reads); rows of padded inputs are garbage.

    Rows are independent positions: several rows may be consecutive positions of one sequence (a
    speculative verify chunk), since each layer stores every row's key and compression state before
    any row closes a window or attends, and a row reads positions up to its own only.

    probe: [B] int64, when given receives the SWA row each row's new token was written to,
    so a caller can check the device-built indices against the host's page tables.
    side: a second CUDA stream; when given, each CSA layer's indexer (its compressor, query,
    scores and top-k) runs on it, beside the main query, key and compressor work."""
    if pools.hot is not None and inp.hot_base is None:
        raise ValueError("HiSparse pools: the decode inputs must name each row's hot buffer (hot_base)")
    compress_rope = model.rope_tables()["compress"]
    index = build_decode_index(inp, pools, model.config.sliding_window, shape, compress_rope)
    if probe is not None:
        probe.copy_(index.new_swa_rows)
    step = model.layer_step(index, pools, inp.positions, kernels=True, side=side)
    streams, _ = model.run_layers(inp.input_ids, step)
    return model.logits(model.head(streams)), streams


__all__ = ["DecodeInputs", "DecodeShape", "decode_step"]
