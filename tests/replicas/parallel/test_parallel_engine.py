"""TP=2, EP=2 and TP=2 x EP=2 replicas (gloo on CPU, real Ray actors) give the one-process
engine's greedy tokens, and logits within 1e-4 (fp32), on one workload that has prefix caching,
chunked prefill, preemption and HiSparse all on; a rank killed mid-request fails its requests
and the engine reports unhealthy."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, SchedulerConfig
from antumbra.replicas.errors import EngineDeadError, RequestFailedError

ATOL = 1e-4
SCHED = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=300)  # the third prompt prefills in chunks
CACHE = CacheConfig(num_virtual_tokens=8 * 128, num_swa_pages=16, hisparse_rows_per_request=16)
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


DOC = tokens(240, seed=1)
# Two pages (256 tokens) each after prefill, a third while decoding: 9 pages of 8. The first
# request crosses its page boundary last, when the others took the free pages: the latest is preempted.
CONCURRENT = [DOC + tokens(10, seed=2), tokens(254, seed=3), tokens(254, seed=4)]
LOGITS_PROMPT = tokens(150, seed=6)


def workload(engine: Engine) -> dict:
    first = engine.generate(CONCURRENT, PARAMS)
    # After the others finished: the first request's pages (and its window's SWA rows) are cached.
    again = engine.generate([CONCURRENT[0] + first[0].token_ids + tokens(20, seed=5)], PARAMS)[0]
    logits = engine.prompt_logits(LOGITS_PROMPT, namespace="logits")
    return {"outs": first + [again], "logits": logits, "stats": engine.stats()}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED, cache=CACHE)
    result = workload(engine)
    stats = result["stats"]
    assert stats["preemptions"] > 0 and stats["host_tier_hits"] > 0
    assert result["outs"][-1].cached_tokens > 0
    return result


def _compare(got: dict, want: dict) -> float:
    worst = (got["logits"] - want["logits"]).abs().max().item()
    for a, b in zip(got["outs"], want["outs"], strict=True):
        assert a.token_ids == b.token_ids
        assert a.cached_tokens == b.cached_tokens
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            worst = max(worst, max(abs(x[t] - y[t]) for t in y))
    assert got["stats"]["preemptions"] == want["stats"]["preemptions"] > 0
    assert worst < ATOL
    return worst


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (2, 1)], ids=["ep2", "tp2xep2", "tp2"])
def test_parallel_replica_matches_one_process(ray_cluster, tiny_checkpoint, reference, tp, ep):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED, cache=CACHE,
                                    tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        worst = _compare(workload(engine), reference)
        print(f"tp={tp} ep={ep}: max |logit / logprob diff| {worst:.2e}; per rank {engine.gang.loads}")
        engine.check_integrity()
        # Every rank ran every step (a rank may still be counting the last one when asked).
        deadline = time.monotonic() + 10
        while len(steps := {s["steps"] for s in engine.gang.stats()}) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(steps) == 1 and steps.pop() > 0
        if tp == 2 and ep == 1:
            _kill_a_rank_mid_request(engine)
    finally:
        engine.shutdown()


def _kill_a_rank_mid_request(engine: Engine) -> None:
    import ray

    got: list = []
    done = threading.Event()

    def sink(item) -> None:
        got.append(item)
        if isinstance(item, BaseException) or item.finished:
            done.set()

    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    engine.submit(tokens(40, seed=9), long, sink)
    deadline = time.monotonic() + 60
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(got) >= 3, "the request never started"
    ray.kill(engine.gang.workers[0])
    assert done.wait(60), "the request neither failed nor finished"
    failure = got[-1]
    assert isinstance(failure, (EngineDeadError, RequestFailedError)), failure
    assert "rank" in str(failure)
    with pytest.raises(EngineDeadError):
        engine.health()
