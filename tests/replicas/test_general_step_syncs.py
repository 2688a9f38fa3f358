"""The general step never waits for the device: no call in it reads device data back.

On CUDA each `.item()`, `.tolist()`, `bool(tensor)`, `nonzero()`, `.cpu()` or boolean-mask index
drains the stream, and the device then idles while the host launches the rest of the step; a copy
from pageable memory does the same. These calls behave alike on CPU, so a torch function mode
records them during real engine steps on CPU (the tiny checkpoint, kernels interpreted and not) and
attributes each to the project frame that made it. `benchmarks/engine/slice_steps.py`'s
`prefill_sync_probe` makes the same check on the H200 with CUDA's own sync detection.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from antumbra import Engine, SamplingParams
from antumbra.config import FastPathConfig, SchedulerConfig

# Tensor methods and functions whose result depends on device data on the host.
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
          "masked_select", "unique", "argwhere"}
# Host data becoming a tensor: on CUDA only `to_device` may do it (pinned memory, asynchronous).
_FACTORIES = {"tensor", "as_tensor", "from_numpy"}
# Syncs this test leaves to their owners: the grouped MoE sizes its loop by the expert counts.
_KEPT = {"moe.py:_grouped"}


def _project_frames() -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_stack() if "/antumbra/" in f.filename]


class SyncRecorder(TorchFunctionMode):
    """Records, for each call in `_READS` / `_FACTORIES` made under `Runner.run` (one general step),
    `file:function` of the innermost project frame; calls inside the Triton interpreter (which runs
    the kernels on CPU through numpy) are the interpreter's, not the step's."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.factories: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and _bool_index(args):
            name = "masked_select"
        if name in _READS or name in _FACTORIES:
            stack = traceback.extract_stack()
            in_step = any(f.name == "run" and f.filename.endswith("replicas/runner.py") for f in stack)
            interpreted = any("/triton/" in f.filename for f in stack)
            frames = _project_frames()
            if in_step and not interpreted and frames:
                where = f"{Path(frames[-1].filename).name}:{frames[-1].name}"
                (self.reads if name in _READS else self.factories).append(f"{where}:{name}")
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    if len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


@pytest.fixture(scope="module")
def short_window_checkpoint(tmp_path_factory):
    from antumbra.config import CSA, HCA
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    spec = TinyModelSpec(sliding_window=16, compress_rates={CSA: 4, HCA: 16})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("syncs") / "model", spec)


def _engine(path, kernels: str) -> Engine:
    return Engine.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        scheduler=SchedulerConfig(max_model_len=256, max_num_batched_tokens=40, max_num_seqs=4),
        fast=FastPathConfig(decode="off", general_kernels=kernels),
    )


def _run(engine: Engine, prompts: list[list[int]], want_prompt_logits: bool = False) -> SyncRecorder:
    """Steps the engine's core in this thread (a torch function mode is per thread) until the
    prompts are done, recording."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    core = engine.core
    ids = [core.add(core.make_request(p, params, want_prompt_logits=want_prompt_logits)) for p in prompts]
    recorder = SyncRecorder()
    with recorder:
        outs = core.run_until_finished(ids)
    assert [len(o.token_ids) for o in outs] == [2] * len(prompts)
    return recorder


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_general_steps_read_nothing_back(short_window_checkpoint, kernels: str) -> None:
    # A 70-token prompt in chunks of up to 40 tokens (a long span, then one starting mid-sequence)
    # beside a 5-token one (a short span, then decodes): C4 and C16 windows close inside chunks.
    engine = _engine(short_window_checkpoint, kernels)
    recorder = _run(engine, [list(range(5, 75)), list(range(3, 8))])
    assert engine.core.num_steps >= 3
    unexpected = [r for r in recorder.reads if r.rsplit(":", 1)[0] not in _KEPT]
    assert unexpected == [], f"device reads in the general step: {sorted(set(unexpected))}"
    copies = [f for f in recorder.factories if not f.startswith("forward_batch.py:to_device:")]
    assert copies == [], f"host data made a tensor outside to_device: {sorted(set(copies))}"
    assert recorder.factories, "the step's index lists reach the device through to_device"


def test_the_recorder_sees_a_read_the_step_keeps(short_window_checkpoint) -> None:
    """Not vacuous: prompt logits asked for are read back to the host in the step, and recorded."""
    recorder = _run(_engine(short_window_checkpoint, "off"), [list(range(5, 45))], want_prompt_logits=True)
    assert "runner.py:_forward:cpu" in recorder.reads


def test_window_closing_rows_from_host_facts_match_their_definition() -> None:
    """`_event_tokens` (arithmetic on each chunk's start, length and replay bound) against the
    mask it replaced: (p + 1) % m == 0 and p + 1 > replay_until, over every token of the step."""
    from antumbra.replicas.model.forward_batch import ForwardBatch, _event_tokens

    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        count = int(torch.randint(1, 5, (1,), generator=gen))
        lengths = torch.randint(1, 40, (count,), generator=gen).tolist()
        starts = torch.randint(0, 300, (count,), generator=gen).tolist()
        replay = [s + int(torch.randint(-20, 60, (1,), generator=gen)) for s in starts]
        spans, row = [], 0
        for n in lengths:
            spans.append((row, row + n))
            row += n
        empty = torch.empty(0, dtype=torch.long)
        batch = ForwardBatch(empty, empty, empty, empty, empty, tuple(spans), tuple(starts),
                             ((),) * count, tuple(max(r, 0) for r in replay))
        for rate in (1, 4, 16, 128):
            want = [
                r0 + j
                for (r0, r1), s, until in zip(spans, starts, batch.replay_until, strict=True)
                for j in range(r1 - r0)
                if (s + j + 1) % rate == 0 and s + j + 1 > until
            ]
            assert _event_tokens(batch, rate) == want
