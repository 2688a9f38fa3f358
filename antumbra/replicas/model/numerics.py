"""Numerics modes of the forward pass.

* `exact`: plain floating point in the model dtype, the arithmetic of transformers' DeepSeek-V4.
* `release`: the quantisation the release checkpoints were trained against (a QAT simulation), as
  the official inference code applies it:
  - KV: the non-RoPE channels of every sliding-window row and of every main compressed (CSA / HCA)
    entry take an FP8 e4m3 round trip (blocks of 64, UE8M0 scales) before they are stored; the
    RoPE channels stay in the model dtype for positional precision.
  - Indexer: queries (after RoPE) and compressed indexer keys (after norm and RoPE) are rotated by a
    normalised Hadamard transform, then take an FP4 e2m1 round trip (blocks of 32, UE8M0 scales).
    Keys are stored rotated and scores are taken between rotated values; the rotation is
    orthonormal, so it changes q·k only through the FP4 rounding.
  - Activations entering an FP8 / FP4 linear take an FP8 round trip (blocks of 128 along the input
    dim): attention q_a / q_b / kv / o_b, indexer q_b, and the shared and routed experts' gate / up /
    down. The routed experts scale each token's down-projection input by its routing weight before
    quantising it, as the release kernels do. `o_a` (a bf16 einsum in the official code), the
    compressor projections, the indexer head weights, the router and the lm head stay unquantised.

In release numerics the pools store the FP8 KV and FP4 indexer codes with their UE8M0 scales
(584 and 68 bytes a row at V4 widths against 1024 and 256 in bf16) and decode them on read, which
gives exactly the round trips' values (`kv_rows.py`; `CacheConfig.kv_storage="model_dtype"` stores
those values unpacked instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.kernels.common.interpreter import interpreting
from antumbra.kernels.kv_codes import triton as codecs

from .quant import FP8_BLOCK, KV_FP8_BLOCK, MXFP4_BLOCK, fp4_roundtrip, fp8_roundtrip, hadamard_rotate

EXACT_MODE = "exact"
RELEASE_MODE = "release"


@dataclass(frozen=True)
class Numerics:
    """Which of the release quantisations are on; each switch is independent (handy for ablations)."""

    kv_fp8: bool = False
    indexer_fp4: bool = False
    act_fp8: bool = False

    @staticmethod
    def of(mode: str) -> Numerics:
        if mode == EXACT_MODE:
            return EXACT
        if mode == RELEASE_MODE:
            return RELEASE
        raise ValueError(f"unknown numerics mode {mode!r}; choose {EXACT_MODE!r} or {RELEASE_MODE!r}")

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Input `[..., K]` of an FP8 / FP4 linear -> the same shape and dtype.

        On CUDA one Triton launch (`kernels/kv_codes`), bitwise equal to the torch chain, which costs
        about ten launches (elsewhere the chain: interpreting the kernel over a prefill is slow)."""
        if not self.act_fp8:
            return x
        if x.is_cuda:
            return codecs.fp8_roundtrip(x)
        return fp8_roundtrip(x, FP8_BLOCK)

    def kv(self, x: torch.Tensor, rope_dim: int) -> torch.Tensor:
        """KV rows `[..., d]`, RoPE on the trailing `rope_dim` channels -> the same shape and dtype."""
        if not self.kv_fp8:
            return x
        nope = x.shape[-1] - rope_dim
        return torch.cat([fp8_roundtrip(x[..., :nope], KV_FP8_BLOCK), x[..., nope:]], dim=-1)

    def indexer(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer queries `[..., H, d]` or keys `[..., d]` -> rotated and rounded, same shape and dtype."""
        return fp4_roundtrip(hadamard_rotate(x), MXFP4_BLOCK) if self.indexer_fp4 else x

    def indexer_queries(self, q: torch.Tensor) -> torch.Tensor:
        """`indexer` of queries `[B, H, d]` in one Triton launch (the fixed-shape decode step; bitwise
        the same values)."""
        if not self.indexer_fp4:
            return q
        return codecs.indexer_roundtrip(q) if q.is_cuda or interpreting() else self.indexer(q)


EXACT = Numerics()
RELEASE = Numerics(kv_fp8=True, indexer_fp4=True, act_fp8=True)
