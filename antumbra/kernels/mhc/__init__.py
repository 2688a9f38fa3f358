"""mHC hyper-connection mixing: pre (norm, mixes, Sinkhorn, collapse) and post (stream update)."""

from .reference import mhc_post_reference, mhc_pre_reference, sinkhorn_reference
from .triton import mhc_post, mhc_pre

__all__ = ["mhc_post", "mhc_post_reference", "mhc_pre", "mhc_pre_reference", "sinkhorn_reference"]
