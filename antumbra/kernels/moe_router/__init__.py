"""The MoE router after its gate projection: scores, the top-k (or hash) choice, routing replay and
the normalised weights in one launch, where the torch chain takes about nine a layer."""

from .reference import SCORINGS, route_reference, scores_reference
from .triton import DTYPES, route, route_constexprs

__all__ = ["DTYPES", "SCORINGS", "route", "route_constexprs", "route_reference", "scores_reference"]
