"""Serve's settings that live in the environment of every process of a cluster the platform starts.

Serve reads these once per process, from the environment the process started with, so they must
be set before the cluster's processes start: `serve_environment` sets them around `ray.init` of a
cluster started here. A cluster started elsewhere (KubeRay, `ray start`) takes them from its own
environment (`serve_loop_env`, which `render_deploy` writes into its manifests).

`serve_loops`: which event loops Serve runs a request on. Serve can give a replica's request
code, each handle's router and its own control loop a thread each; a streamed chunk then crosses
threads at every hop and at each crossing waits for the GIL behind whatever Python another thread
of that process runs. `one` runs all three on Serve's own loop, as Serve's throughput-optimised
mode does; `separate` is Serve's default. The model replica's engine keeps its own thread or
process either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

SERVE_LOOPS = ("one", "separate")
DEFAULT_SERVE_LOOPS = "separate"


def serve_loop_env(loops: str) -> dict[str, str]:
    """The environment variables of Serve that select `loops` (one of `SERVE_LOOPS`)."""
    if loops not in SERVE_LOOPS:
        raise ValueError(f"serve_loops must be one of {list(SERVE_LOOPS)}, got {loops!r}")
    separate = "1" if loops == "separate" else "0"
    return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": separate,
            "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": separate}


@contextlib.contextmanager
def serve_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """`variables` in this process's environment inside the block (for the processes it starts),
    and the environment as it was after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
