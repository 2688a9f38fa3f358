"""Overlap scheduling (replicas/overlap.py): decode steps launched before the previous step's
tokens are read back give the general path's tokens and finish reasons, on CPU with the
fixed-shape step's kernels interpreted (the H200 run times it: benchmarks/engine/slice.py)."""

from __future__ import annotations

from antumbra import Engine, SamplingParams
from antumbra.config import FastPathConfig, SchedulerConfig
from antumbra.replicas.decode_graphs import PENDING

PROMPTS = [list(range(3, 3 + n)) for n in (2, 9, 130)]


def _engine(path, decode: str, overlap: bool = True) -> Engine:
    return Engine.from_pretrained(
        path, device="cpu", dtype="float32",
        scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=4),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 4), overlap_schedule=overlap),
    )


def test_overlapped_decodes_match_the_general_path(tiny_checkpoint):
    reference = _engine(tiny_checkpoint, "off")
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = reference.generate(PROMPTS, free)
    # Request 1 stops on a value (its 3rd token), the others by length at different counts.
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[first[1].token_ids[2]]),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    want = [reference.generate([p], q)[0] for p, q in zip(PROMPTS, params, strict=True)]
    engine = _engine(tiny_checkpoint, "on")
    core = engine.core
    ids = [core.add_request(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    final = {}
    for _ in range(40):
        if not core.has_work():
            break
        for out in core.step():
            assert PENDING not in out.token_ids
            seen[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    assert core.overlap.num_overlapped_steps >= 3
    for rid, ref in zip(ids, want, strict=True):
        assert final[rid].token_ids == ref.token_ids
        assert final[rid].finish_reason == ref.finish_reason
        assert seen[rid] == ref.token_ids  # streamed once each, in order
    engine.check_integrity()


def test_an_abort_in_flight_leaves_no_pending_token(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, "on")
    core = engine.core
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    keep, drop = core.add_request(PROMPTS[0], params), core.add_request(PROMPTS[1], params)
    for _ in range(4):
        core.step()
    assert core.overlap.inflight is not None
    aborted = core.abort(drop)
    assert aborted is not None and PENDING not in aborted.token_ids
    core.step()
    core.overlap.enabled = False  # switched off with a step in flight: the next step reads its tokens
    (out,) = core.run_until_finished([keep])
    assert out.token_ids == _engine(tiny_checkpoint, "off").generate([PROMPTS[0]], params)[0].token_ids
    engine.check_integrity()


def test_a_parallel_replica_does_not_overlap(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, "on")
    sent = []
    engine.runner.fast.before_step = lambda size, count: sent.append((size, count))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([PROMPTS[0]], params)
    assert engine.core.overlap.num_overlapped_steps == 0 and sent  # every decode went through `run`
