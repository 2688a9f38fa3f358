"""The replica's engine: `Engine` (engine.py), the public face of one replica.

It sits above the rest of `replicas/`: it composes the core with the parts a plain core does not
know, prefill / decode disaggregation (`kv_transfer/`) and parallel ranks (`parallel/`), so those
packages import the core and never the other way round.
"""

from .engine import Engine

__all__ = ["Engine"]
