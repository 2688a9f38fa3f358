"""CPU time of the platform's processes over a stretch of load, per process kind (Linux `/proc`).

Ray titles its worker processes by what they run (`ray::ProxyActor`, `ray::ServeReplica:<app>:<deployment>`);
a replica's engine process is a child of its replica. `cpu_seconds()` sums each kind's user and
system time now; two snapshots around a level give each kind's CPU seconds and, over the chunks
the level streamed, its CPU time per chunk: which process is busiest per token, and how near one
core a single-process hop (Serve's proxy) runs. A snapshot pair over an unloaded stretch gives what
each kind spends at rest (health checks, metrics), to set against the loaded figures.
`busiest_threads` does the same per thread of given processes (a replica's engine process): whether
one thread, the engine's stepping thread, is near a core and what the others take beside it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process; None if it is gone."""
    return _read_stat(PROC / str(pid) / "stat")


def _read_stat(path: Path) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) from a process's or a thread's `stat`; None if gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def _live_stats() -> dict[int, tuple[int, float]]:
    """`_stat` of every live process."""
    pids = [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    return {pid: s for pid in pids if (s := _stat(pid)) is not None}


def _title(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def kind_of(title: str, deployments: Collection[str]) -> str | None:
    """The kind of a Ray process by its title: `proxy`, `controller`, `replica:<deployment>` for one
    of `deployments`, and in Serve's HAProxy mode `haproxy` and `haproxy_manager`; None for any
    other. A busy actor's title ends in the method it runs (`ray::ServeReplica:app:Ingress.handle_request`),
    and a deployment's name may hold dots itself, so the deployment is matched by name, not split off."""
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    if title.startswith("ray::HAProxyManager"):
        return "haproxy_manager"
    if title.split(" ", 1)[0].endswith("/haproxy"):  # the HAProxy that Serve's HAProxy mode runs
        return "haproxy"
    if title.startswith("ray::ServeController"):
        return "controller"
    if not title.startswith("ray::ServeReplica:"):
        return None
    _, _, rest = title.split()[0].removeprefix("ray::ServeReplica:").partition(":")  # after the app
    for deployment in sorted(deployments, key=len, reverse=True):
        if rest == deployment or rest.startswith(deployment + "."):
            return f"replica:{deployment}"
    return None


def cpu_seconds(deployments: Collection[str]) -> dict[str, float]:
    """CPU seconds so far per kind (a replica's child processes counted with it); and `driver`, this
    process."""
    stats = _live_stats()
    kinds = {pid: k for pid in stats if (k := kind_of(_title(pid), deployments)) is not None}
    totals: dict[str, float] = {"driver": stats.get(os.getpid(), (0, 0.0))[1]}
    for pid, (parent, seconds) in stats.items():
        kind = kinds.get(pid) or kinds.get(parent)  # an engine process counts with its replica
        if kind is not None:
            totals[kind] = totals.get(kind, 0.0) + seconds
    return totals


def cpu_per_chunk(before: dict[str, float], after: dict[str, float], wall_s: float,
                  chunks: int) -> dict[str, dict[str, float]]:
    """Per kind: CPU seconds between two snapshots, as cores busy over `wall_s` and as microseconds
    per streamed chunk."""
    out = {}
    for kind in sorted(after):
        used = after[kind] - before.get(kind, 0.0)
        out[kind] = {"cpu_s": used, "cores": used / wall_s if wall_s > 0 else 0.0,
                     "us_per_chunk": used / chunks * 1e6 if chunks else 0.0}
    return out


def thread_seconds(pid: int) -> dict[int, float]:
    """Each live thread of `pid`: user + system CPU seconds so far, by thread id."""
    try:
        tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
    except OSError:
        return {}
    return {tid: s[1] for tid in tids if (s := _read_stat(PROC / str(pid) / "task" / str(tid) / "stat"))}


def engine_process_pids(deployment: str) -> list[int]:
    """The engine processes of `deployment`'s replicas: children of its replica processes."""
    stats = _live_stats()
    replicas = {pid for pid in stats if kind_of(_title(pid), [deployment]) == f"replica:{deployment}"}
    return [pid for pid, (parent, _) in stats.items() if parent in replicas]


def busiest_threads(pids: Collection[int], before: dict[int, dict[int, float]], wall_s: float,
                    names: dict[int, str] | None = None, top: int = 6) -> list[tuple[str, float]]:
    """The `top` busiest threads of `pids` since the `before` snapshot (`{pid: thread_seconds(pid)}`),
    as (name, cores busy over `wall_s`), busiest first: one thread near 1.0 is a process bound by that
    thread; the rest are what shares its interpreter. Names come from `names` (native id -> Python
    thread name); a thread without one (torch's, or no `names`) is "native <id>"."""
    if wall_s <= 0:
        return []
    used = sorted(((seconds - before.get(pid, {}).get(tid, 0.0), tid)
                   for pid in pids for tid, seconds in thread_seconds(pid).items()), reverse=True)
    known = names or {}
    return [(known.get(tid, f"native {tid}"), u / wall_s) for u, tid in used[:top]]
