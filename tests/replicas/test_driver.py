"""The driver built directly on an engine core: the stepping thread hands token outputs to the
output thread, which makes their text, finds stop strings and feeds each sink in order; a stop
found there comes back as a command the driver applies before its next step."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from antumbra import Engine, SamplingParams
from antumbra.replicas.driver import Driver
from antumbra.replicas.request import RequestOutput

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def driver(tiny_checkpoint):
    core = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32").core
    driver = Driver(core)
    yield driver
    driver.stop()


def _run(driver: Driver, prompt: str, params: SamplingParams) -> tuple[list[RequestOutput], set[str]]:
    """Submit one request and wait; -> every output its sink got, and the threads it got them on."""
    outputs: list[RequestOutput] = []
    threads: set[str] = set()

    def sink(item):
        assert isinstance(item, RequestOutput)
        threads.add(threading.current_thread().name)
        outputs.append(item)

    driver.submit(driver.core.make_request(prompt, params), sink)
    assert driver.wait_idle(60)
    return outputs, threads


def test_outputs_reach_their_sink_in_order_with_their_text(driver):
    outputs, threads = _run(driver, "Hello", GREEDY)
    final = outputs[-1]
    assert threads == {"engine-output"}
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert final.finish_reason == "length" and len(final.token_ids) == 10
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in outputs) == final.text and final.text
    for earlier, later in zip(outputs, outputs[1:], strict=False):
        assert later.token_ids[: len(earlier.token_ids)] == earlier.token_ids


def test_a_stop_string_found_on_the_output_thread_ends_the_request_in_the_core(driver):
    (*_, free), _ = _run(driver, "Hello", GREEDY)
    stop = free.text[3:5]
    outputs, _ = _run(driver, "Hello", dataclasses.replace(GREEDY, stop=[stop]))
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.text == free.text[: free.text.index(stop)]
    n = len(final.token_ids)
    assert final.token_ids == free.token_ids[:n] and n < len(free.token_ids)
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids  # nothing past the stop
    core = driver.core
    assert not core.requests and not core.has_work()
    core.check_integrity()


def test_a_core_driven_by_hand_makes_the_same_text_and_stops(driver):
    (*_, free), _ = _run(driver, "Hello", GREEDY)  # through the driver (its threads idle after)
    stop = free.text[3:5]
    core = driver.core
    rid = core.add_request("Hello", dataclasses.replace(GREEDY, stop=[stop]))
    (out,) = core.run_until_finished([rid])
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and not core.has_work()


def test_outputs_held_for_the_next_readback_arrive_as_without_holding(tiny_checkpoint):
    from antumbra.config import FastPathConfig, SchedulerConfig

    engine = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32", scheduler=SchedulerConfig(max_num_seqs=4),
        fast=FastPathConfig(decode="on", cuda_graph_batch_sizes=(1, 4), overlap_schedule=True),
    )
    driver = engine.driver
    (*_, free), _ = _run(driver, "Hello", GREEDY)
    stop = free.text[3:5]
    params = [GREEDY, dataclasses.replace(GREEDY, stop=[stop])]
    plain = [_run(driver, "Hello", p)[0] for p in params]
    assert driver.num_held_steps == 0  # off by default: nothing is held
    driver.hold_outputs = True  # as it would run on a GPU, whose launched step runs while the host waits
    held = [_run(driver, "Hello", p)[0] for p in params]
    assert driver.num_held_steps > 0 and engine.core.overlap.num_overlapped_steps > 0
    for want, got in zip(plain, held, strict=True):
        assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
        assert [o.new_text for o in got] == [o.new_text for o in want]
        assert got[-1].finish_reason == want[-1].finish_reason and got[-1].text == want[-1].text
    assert held[1][-1].finish_reason == "stop"
    assert not engine.core.requests and not engine.core.has_work()
    engine.check_integrity()
