"""Allowed-token masks (structured output): packed int32 bitmasks applied to logits."""

from .reference import apply_token_mask_reference, pack_allowed_reference, unpack_bits_reference, words_for
from .triton import apply_token_mask

__all__ = [
    "apply_token_mask",
    "apply_token_mask_reference",
    "pack_allowed_reference",
    "unpack_bits_reference",
    "words_for",
]
