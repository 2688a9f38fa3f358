"""mHC hyper-connection mixing: pre (norm, mixes, Sinkhorn, collapse), post (stream update) and the
head's final collapse."""

from .reference import mhc_head_reference, mhc_post_reference, mhc_pre_reference, sinkhorn_reference
from .triton import mhc_head, mhc_post, mhc_pre

__all__ = [
    "mhc_head", "mhc_head_reference", "mhc_post", "mhc_post_reference", "mhc_pre", "mhc_pre_reference",
    "sinkhorn_reference",
]
