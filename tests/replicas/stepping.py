"""Stepping an engine's core by hand, for tests that compare two engines step for step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from antumbra.replicas.engine import Engine
from antumbra.replicas.request import RequestOutput
from antumbra.replicas.sampling_params import SamplingParams


def run_by_hand(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                after_step: Callable[[], None] | None = None) -> list[RequestOutput]:
    """Queue every prompt first (so each step's batch is the scheduler's choice alone, not how fast
    requests arrived), then step the core until all finish, checking integrity after every step.
    -> the final outputs in prompt order."""
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    rids = [engine.core.add_request(p, sp) for p, sp in zip(prompts, per_request, strict=True)]
    finished: dict[str, RequestOutput] = {}
    while engine.core.has_work():
        for out in engine.core.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
        if after_step is not None:
            after_step()
    return [finished[rid] for rid in rids]


def assert_same_outputs(reference: list[RequestOutput], got: list[RequestOutput], tolerance: float) -> None:
    """Equal tokens, and logprobs of the same tokens within `tolerance`."""
    for ref, out in zip(reference, got, strict=True):
        assert out.token_ids == ref.token_ids
        assert (out.logprobs is None) == (ref.logprobs is None)
        for want, have in zip(ref.logprobs or [], out.logprobs or [], strict=True):
            assert set(have) == set(want)
            for token, value in want.items():
                assert have[token] == pytest.approx(value, abs=tolerance)
