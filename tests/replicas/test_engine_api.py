"""The engine's public contract: bad input is refused cleanly, streaming, seeds, stops, aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from antumbra.replicas.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32",
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256))


def assert_idle_and_intact(engine: Engine) -> None:
    """No request holds anything; every page is free or cached, and clearing the cache frees all."""
    assert engine.wait_idle(30), "the engine did not become idle"
    engine.check_integrity()
    assert not engine.core.has_work()
    engine.clear_cache()
    engine.check_integrity()
    assert engine.pools.num_free_virtual_pages == engine.pools.layout.num_virtual_pages
    assert engine.pools.num_free_swa_pages == engine.pools.layout.num_swa_pages


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ([], "empty"),
        ("", "empty"),
        ([5, -1, 7], "outside the vocabulary"),
        ([5, 10**6], "outside the vocabulary"),
        ([5, 6.5], "integers"),
        ([5, True, 7], "integers"),  # a bool is an int subclass, not a token id
        (None, "string or a list"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_keeps_serving(engine, prompt, fragment):
    reference = engine.generate([[5, 6, 7, 8]], GREEDY)[0]
    engine.core.add_request([9, 10, 11], GREEDY, request_id="bystander")
    engine.core.step()
    with pytest.raises(InvalidRequestError, match=fragment):
        engine.core.add_request(prompt, GREEDY)
    bystander = engine.core.run_until_finished(["bystander"])[0]
    assert len(bystander.token_ids) == 8
    assert engine.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids == reference.token_ids
    assert_idle_and_intact(engine)


def test_prompt_longer_than_the_context_is_refused(engine):
    too_long = [5] * engine.max_model_len
    with pytest.raises(InvalidRequestError, match="context"):
        engine.generate([too_long], GREEDY)
    assert_idle_and_intact(engine)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_parameters_name_the_parameter(engine, kwargs, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kwargs)
    assert engine.generate([[5, 6]], GREEDY)[0].finish_reason == "length"
    assert_idle_and_intact(engine)


def test_stop_token_ids_out_of_vocabulary_are_refused(engine):
    with pytest.raises(InvalidRequestError):
        engine.core.add_request([5, 6], SamplingParams(stop_token_ids=[10**6]))
    assert_idle_and_intact(engine)


def test_seeded_sampling_is_reproducible_inside_any_batch(engine):
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], seeded)[0]
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    mixed = engine.generate([[40, 41] * 30, [5, 6, 7], [9] * 200], [other, seeded, other])
    assert mixed[1].token_ids == alone.token_ids
    assert_idle_and_intact(engine)


def test_stop_string_truncates_text(engine):
    free = engine.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) >= 4
    stop = text[2:4]
    stopped = engine.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                        stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert_idle_and_intact(engine)


def test_stream_deltas_add_up_and_cancel_aborts(engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = engine.generate(["Streaming test"], params)[0]

    async def consume() -> tuple[list[int], str, str | None]:
        tokens, text, reason = [], "", None
        async for out in engine.stream("Streaming test", params):
            tokens += out.new_token_ids
            text += out.new_text
            reason = out.finish_reason
        return tokens, text, reason

    tokens, text, reason = asyncio.run(consume())
    assert tokens == expected.token_ids
    assert text == expected.text
    assert reason == "length"

    async def cancel_early() -> int:
        seen = 0
        stream = engine.stream([5] * 300, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(cancel_early()) == 2
    assert_idle_and_intact(engine)


def test_abort_mid_prefill_releases_everything(engine):
    rid = engine.core.add_request([7] * 900, GREEDY)
    engine.core.step()
    assert engine.core.abort(rid) is not None
    assert engine.core.abort(rid) is None
    assert_idle_and_intact(engine)


def test_many_concurrent_requests_under_a_small_budget_all_finish(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32",
                                    scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64))
    prompts = [[5 + i] * (20 + 37 * i) for i in range(7)]
    outs = engine.generate(prompts, GREEDY)
    assert [len(o.token_ids) for o in outs] == [8] * 7
    for prompt, out in zip(prompts, outs, strict=True):
        assert engine.generate([prompt], GREEDY)[0].token_ids == out.token_ids
    assert_idle_and_intact(engine)


def test_integer_like_token_ids_are_taken_as_ints(engine):
    """The fast check takes plain int lists; other integer sequences (a tensor, numpy ints) still pass the
    element-by-element one and give the same ids."""
    import numpy as np

    from antumbra.replicas.validation import prompt_token_ids

    plain = [5, 6, 7, 8]
    for prompt in (plain, tuple(plain), torch.tensor(plain), [np.int64(t) for t in plain]):
        ids = prompt_token_ids(prompt, None)
        assert ids == plain and all(type(t) is int for t in ids)
    assert prompt_token_ids(plain, None) is not plain  # a copy: the caller's list stays theirs
    from_tensor = engine.generate([torch.tensor(plain)], GREEDY)[0].token_ids
    assert from_tensor == engine.generate([plain], GREEDY)[0].token_ids


def test_text_is_made_on_the_output_thread_not_the_stepping_one(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate(["Hello"], params)[0]
    stop = expected.text[3:5]
    tokenizer, threads = engine.tokenizer, set()
    decode = tokenizer.decode

    def recording_decode(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return decode(*args, **kwargs)

    tokenizer.decode = recording_decode
    try:
        stopped = engine.generate(["Hello"], dataclasses.replace(params, stop=[stop]))[0]
    finally:
        del tokenizer.decode
    assert threads == {"engine-output"}
    # The stop string was found there; the request still ends exactly at the token that completed it.
    assert stopped.finish_reason == "stop" and stopped.text == expected.text[: expected.text.index(stop)]
    n = len(stopped.token_ids)
    assert stopped.token_ids == expected.token_ids[:n] and n < len(expected.token_ids)
    assert_idle_and_intact(engine)
