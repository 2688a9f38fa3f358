"""What every layer reads for one forward step, and the choices the step was planned with.

One layer implementation serves every step. The general step (any mix of prefill chunks and decodes)
hands the layers a `StepIndex` built from host-side facts; the fixed-shape decode step, which a CUDA
graph captures, a `DecodeIndex` built on the device. Attention and the MoE read the index through
`LayerStep` and pick their implementation from it and from `kernels` (the execution plan's choice of
the Triton kernels, `replicas/plan.py`): nothing else tells the two steps apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import SLIDING
from antumbra.kernels.rms_norm.triton import fuses_fp8, rms_norm_fp8

from .decode_index import DecodeIndex
from .forward_batch import StepIndex
from .norms import RMSNorm
from .numerics import Numerics
from .rope import RotaryTable


@dataclass(frozen=True)
class LayerStep:
    index: StepIndex | DecodeIndex  # the step's rows into the pools (host- or device-built)
    pools: KVPools
    cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]]  # rope table name -> (cos, sin) at the positions
    compress_rope: RotaryTable  # rotates the entries of windows the step closes
    kernels: bool  # the Triton kernels (mHC, fused norms and RoPE, compressor, indexer, attention)
    # Fixed-shape step only: a second CUDA stream the CSA indexers run on, beside the main stream.
    side: torch.cuda.Stream | None = None

    @property
    def fixed_shape(self) -> bool:
        """Every size is fixed and no op may wait for the host (the step a CUDA graph holds)."""
        return isinstance(self.index, DecodeIndex)

    def rope_for(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding layers rotate with the main table, compressed ones with the compress table."""
        return self.cos_sin["main" if layer_type == SLIDING else "compress"]


def normed(
    norm: RMSNorm, x: torch.Tensor, numerics: Numerics, kernels: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), numerics.act of it): release numerics feed the norm's output unrounded to the
    compressors, indexer weights and router, and FP8-rounded to the linears; with the kernels on
    CUDA one launch makes both (`rms_norm_fp8`). Without activation rounding both are one tensor."""
    if kernels and numerics.act_fp8 and x.is_cuda and fuses_fp8(x.shape[-1]):
        return rms_norm_fp8(x, norm.weight.float(), norm.eps)
    y = norm(x)
    return y, numerics.act(y)
