"""Rotary embedding of the trailing channels, one launch per tensor, and the cos / sin tables of a
step's positions, one launch per table."""

from .angles import cos_sin
from .reference import cos_sin_reference, rope_reference
from .triton import rope

__all__ = ["cos_sin", "cos_sin_reference", "rope", "rope_reference"]
