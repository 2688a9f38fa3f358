"""The benchmarks' hand stepping of an engine's core after its driver has run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from antumbra import Engine, SamplingParams
from benchmarks.engine.slice_steps import launch_sites, settle, step_to_first_tokens, stepped_by_hand

PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [4, 4, 6, 1, 9]]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")


def test_stepping_by_hand_holds_the_driver_off_and_reaches_every_first_token(engine: Engine) -> None:
    engine.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    read: list[float] = []
    with stepped_by_hand(engine) as core:
        reader = threading.Thread(target=lambda: read.append(engine.stats()["num_running"]))
        reader.start()
        ids = [core.add_request(p, params) for p in PROMPTS]
        step_to_first_tokens(core, ids)
        assert all(core.requests[r].output_token_ids for r in ids)
        reader.join(0.2)
        assert reader.is_alive() and not read  # a reader takes the driver's lock: it waits for us
        for r in ids:
            core.abort(r)
        settle(engine)
    reader.join(10)
    assert read == [0.0]
    engine.check_integrity()


def test_a_request_that_ends_before_its_first_token_is_read_says_how(engine: Engine) -> None:
    with stepped_by_hand(engine) as core:
        rid = core.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        with pytest.raises(RuntimeError, match=f"request {rid} ended before the timed steps: length"):
            step_to_first_tokens(core, [rid])
        settle(engine)
    engine.check_integrity()


def test_launch_sites_name_the_model_lines_that_call_each_op(engine: Engine) -> None:
    """On a CPU the sites carry CPU time; the same rows on a GPU carry each op's kernels' time."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    with stepped_by_hand(engine) as core:
        ids = [core.add_request(p, params) for p in PROMPTS]
        step_to_first_tokens(core, ids)
        rows = launch_sites(engine, "cpu", steps=2, top=500)
        for r in ids:
            core.abort(r)
        settle(engine)
    assert rows and all(r["us_per_step"] > 0 and r["calls_per_step"] > 0 for r in rows)
    sites = {r["site"].split(" < ")[0] for r in rows}
    assert any(site.startswith("replicas/model/") for site in sites), sites
    mms = [r for r in rows if r["op"] in ("aten::mm", "aten::addmm", "aten::linear")]
    assert mms and all(r["site"] for r in mms)  # every projection is called from a model line
    engine.check_integrity()
