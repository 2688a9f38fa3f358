"""The supervisor of the platform's own redis-server: a SIGKILLed server is started again, with its data."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import redis

from antumbra.platform.launch.redis_server import HOST, LocalRedis, ping
from antumbra.platform.launch.redis_supervisor import RedisSupervisor
from tests.waiting import wait_until


def test_a_killed_server_comes_back_with_its_data_and_a_stopped_supervisor_leaves_it(tmp_path: Path) -> None:
    server = LocalRedis(data_dir=tmp_path)
    server.start()
    supervisor = RedisSupervisor(server).start()
    try:
        redis.Redis(host=HOST, port=server.port).set("tenant", "kept")
        for round_ in (1, 2):
            killed = server.pid
            assert killed is not None
            os.kill(killed, signal.SIGKILL)
            # Generous on a loaded machine; the supervisor polls every 0.2 s.
            wait_until(lambda k=killed: server.pid not in (None, k) and ping(HOST, server.port), 30,
                       f"the server started again (round {round_})")
            assert redis.Redis(host=HOST, port=server.port).get("tenant") == b"kept"
            assert supervisor.restarts == round_
        with supervisor.paused():
            server.kill()
            polls = supervisor.polls
            wait_until(lambda: supervisor.polls >= polls + 5, 30, "five polls while paused")
            assert not ping(HOST, server.port) and supervisor.restarts == 2
        wait_until(lambda: ping(HOST, server.port), 30, "the server started again after the pause")
        supervisor.stop()  # joins its thread: nothing can start the server after this
        server.kill()
        assert not ping(HOST, server.port), "a stopped supervisor restarted the server"
    finally:
        supervisor.stop()
        server.stop()
