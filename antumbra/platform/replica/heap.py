"""The replica process's start-up objects kept out of the cyclic garbage collector's walks.

A full collection walks every object the collector tracks. Once a replica has loaded its model,
compiled its kernels and captured its graphs, that is hundreds of thousands of objects (torch, Ray,
Serve, the engine), and a collection that walks them all holds the GIL, so the engine's stepping
thread stops mid-step for as long as the walk takes and every stream's inter-token gap widens at once.
The objects alive when the replica is ready live as long as its process, so after one collection
clears what start-up left behind they move to the permanent generation (`gc.freeze`); later
collections walk only what serving allocated. What this gives up: a reference cycle among the frozen
objects that becomes garbage later is never collected, so it is for a process that keeps one engine
for its whole life (a deployed replica), not for one that builds engine after engine (tests).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still tracked -> how many the permanent generation holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
