"""Weighted RMS norm: one launch per tensor."""

from .reference import rms_norm_reference
from .triton import rms_norm

__all__ = ["rms_norm", "rms_norm_reference"]
