"""Keeps the redis-server that `antumbra serve` started alive: a thread restarts it when it dies.

The supervisor polls the process every `poll_s` (0.2 s) and starts a dead server again on the same
port with the same data directory, so with persistence (`LocalRedis(data_dir=...)`) it comes back
with its tenants, keys and usage, typically well within a second; a start that fails is tried again
each poll. An external Redis (`--redis-url`) gets no supervisor: the platform only reports it
(`/health`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from antumbra.platform.launch.redis_server import LocalRedis, RedisStartError

log = logging.getLogger(__name__)


class RedisSupervisor:
    """Restarts `redis` whenever its process has exited (module docstring); `stop()` before stopping
    the server itself, or the supervisor starts it again."""

    def __init__(self, redis: LocalRedis, poll_s: float = 0.2) -> None:
        self.redis = redis
        self.poll_s = poll_s
        self.restarts = 0
        self.polls = 0  # looks taken at the process, paused or not (tests wait on it)
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RedisSupervisor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="redis-supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No restarts inside the block (a test that needs Redis down for a while)."""
        self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.polls += 1
            if self._paused.is_set() or self.redis.is_running():
                continue
            self._restart()

    def _restart(self) -> None:
        self.redis.kill()  # reaps the dead process and removes its scratch directory
        try:
            url = self.redis.start()
        except RedisStartError as exc:
            log.error("redis-server died and could not be started again (retrying): %s", exc)
            return
        self.restarts += 1
        log.warning("redis-server died; started again at %s (restart %d)", url, self.restarts)
