"""Penalties through the engine, on the device-resident state (`EngineCore.penalties`): every
step's tokens equal the host reference path's (sparse entries from each request's host history,
`penalty_reference.py`), greedy and seeded, in batches mixing penalised and plain rows; the
state's counts equal the host's after every step, with overlap scheduling, preemption and
aborts; a finished or aborted request's slot is freed and reused clean."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig
from antumbra.replicas.core import EngineCore
from antumbra.replicas.step_io import PENDING
from tests.replicas.penalty_reference import host_tokens

PENALISED = [
    # Negative penalties on a greedy row: a near-flat random model repeats what it has said.
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=-1.5,
                   presence_penalty=-2.0),
    SamplingParams(max_tokens=10, seed=5, repetition_penalty=1.7, logit_bias={7: 3.0, 9: -2.0}, min_p=0.05),
    SamplingParams(max_tokens=9, seed=6, temperature=0.8, min_tokens=6, presence_penalty=-1.0,
                   stop_token_ids=(11,)),
    SamplingParams(max_tokens=8, seed=8, top_k=30, frequency_penalty=0.6),
]
PLAIN = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def witness(core: EngineCore) -> list[int]:
    """Check every draw of `core` against the host reference as it happens (the core's own sampler
    and rows, unchanged); -> a one-item list counting the rows checked."""
    checked = [0]
    histories: list[tuple[Any, list[int], list[int]]] = []
    build_rows: Callable = core.runner._rows
    sample_tokens: Callable = core.sampler.sample_tokens

    def rows(sampling: list) -> Any:
        histories[:] = [(r.params, list(r.prompt_token_ids), [t for t in r.output_token_ids if t != PENDING])
                        for r in sampling]
        return build_rows(sampling)

    def sample(logits: torch.Tensor, step_rows: Any, *args: Any) -> torch.Tensor:
        got = sample_tokens(logits, step_rows, *args)
        params, prompts, outputs = zip(*histories, strict=True)
        want = host_tokens(logits.cpu(), step_rows.packed, params, prompts, outputs, core.eos_token_ids)
        assert got.tolist() == want
        checked[0] += len(want)
        return got

    core.runner._rows = rows  # type: ignore[method-assign]
    core.sampler.sample_tokens = sample  # type: ignore[method-assign]
    return checked


def counts_match_host(core: EngineCore) -> int:
    """Assert each live penalised request's device counts equal a count of its host output; -> how
    many requests were compared."""
    compared = 0
    for request in core.requests.values():
        slot = core.penalties.slot_of(request.request_id)
        if slot is None:
            continue
        output = [t for t in request.output_token_ids if t != PENDING]
        host = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=core.penalties.vocab).int()
        ahead = core.penalties.tables.counts[slot].cpu() - host  # a token in flight is counted already
        pending = len(request.output_token_ids) - len(output)
        assert int(ahead.sum()) == pending and int(ahead.min()) >= 0, request.request_id
        compared += 1
    return compared


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict, int]:
    core = engine.core
    ids = [core.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    final, compared = {}, 0
    while core.has_work():
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        compared += counts_match_host(core)
        engine.check_integrity()
    return {rid: final[rid].token_ids for rid in ids}, compared


def test_engine_draws_equal_the_host_reference_and_counts_match(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    checked = witness(engine.core)
    prompts = [_prompt(20 + 7 * i, i) for i in range(6)]
    params = [*PENALISED, PLAIN, PLAIN]
    tokens, compared = _run(engine, prompts, params)
    assert checked[0] >= sum(p.max_tokens for p in params) and compared > 20
    assert engine.core.penalties.capacity > 0
    engine.core.penalties.check_integrity(live=[])  # every slot freed
    # The penalties act: the greedy row repeats itself, which it does not without them.
    penalised = list(tokens.values())[0]
    plain = engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(set(penalised)) < len(penalised) and plain[0].token_ids != penalised
    # Seeded rows are reproducible: the same requests again draw the same tokens.
    again, _ = _run(engine, prompts, params)
    assert list(again.values()) == list(tokens.values())


def test_overlap_scheduling_keeps_counts_and_tokens(tiny_checkpoint):
    def engine(overlap: bool) -> Engine:
        return Engine.from_pretrained(
            tiny_checkpoint, device="cpu", dtype="float32",
            scheduler=SchedulerConfig(max_model_len=512, max_num_seqs=4),
            fast=FastPathConfig(decode="on" if overlap else "off", cuda_graph_batch_sizes=(1, 4),
                                overlap_schedule=overlap),
        )

    prompts = [_prompt(9, 1), _prompt(14, 2), _prompt(11, 3)]
    params = [PLAIN, PENALISED[0], PENALISED[1]]
    reference = engine(False)
    witness(reference.core)
    want = [reference.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    overlapped = engine(True)
    core = overlapped.core
    plain_id = core.add_request(prompts[0], PLAIN)
    for _ in range(4):  # plain decodes overlap alone first
        core.step()
    alone = core.overlap.num_overlapped_steps
    assert alone > 0
    penalised_ids = [core.add_request(p, q) for p, q in zip(prompts[1:], params[1:], strict=True)]
    final, ahead = {}, 0
    while core.has_work():
        for out in core.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        ahead += counts_match_host(core)
        overlapped.check_integrity()
    # Penalised rows overlap too: their draws and counts happen in the fixed-shape step's race.
    assert core.overlap.num_overlapped_steps > alone + 3 and ahead > 0
    assert [final[rid] for rid in [plain_id, *penalised_ids]] == want


def test_preemption_keeps_counts_and_tokens(tiny_checkpoint):
    params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, frequency_penalty=0.9,
                             repetition_penalty=1.3, logit_bias={5: 1.0}) for _ in range(6)]
    prompts = [_prompt(260 + 30 * i, 40 + i) for i in range(6)]
    roomy = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = Engine.from_pretrained(
        tiny_checkpoint, device="cpu", dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=512),
        cache=CacheConfig(num_virtual_tokens=12 * 128),
    )
    witness(tight.core)
    tokens, compared = _run(tight, prompts, params)
    assert tight.stats()["preemptions"] > 0 and compared > 0
    assert list(tokens.values()) == expected


def test_an_aborted_request_frees_its_slot_for_the_next(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    core = engine.core
    witness(core)
    first = core.add_request(_prompt(12, 3), PENALISED[0])
    for _ in range(4):
        core.step()
    slot = core.penalties.slot_of(first)
    assert slot is not None
    core.abort(first)
    assert core.penalties.slot_of(first) is None
    engine.check_integrity()
    second = core.add_request(_prompt(15, 4), PENALISED[1])
    core.step()
    assert core.penalties.slot_of(second) == slot  # reused, and clean: its counts are its own
    assert counts_match_host(core) == 1
    core.run_until_finished([second])
    engine.check_integrity()
