"""Rotary embedding of the trailing channels: one launch per tensor."""

from .reference import rope_reference
from .triton import rope

__all__ = ["rope", "rope_reference"]
