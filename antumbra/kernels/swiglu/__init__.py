"""The shared expert's clamped SwiGLU [T, I] (bfloat16 / float32), with release numerics' FP8
round trip fused: one launch where the torch chain takes five (the decode graph runs it a layer)."""

from .reference import swiglu_reference
from .triton import DTYPES, swiglu, swiglu_constexprs

__all__ = ["DTYPES", "swiglu", "swiglu_constexprs", "swiglu_reference"]
