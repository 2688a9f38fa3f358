"""The one-launch top-k (`indexer_topk/onepass.py`) against the reference, on the CPU interpreter.

With several programs a row the interpreter runs the stages as separate launches (a grid barrier
would never open there); with one program a row it runs the one-launch form, barriers included.
Both tie-resolution paths are covered: every program searching the whole tie list (`rank_all`
large, `rank_own_max=0`) and each ranking its own entries (`rank_all=0`, the third barrier's path).
"""

from __future__ import annotations

import zlib

import pytest
import torch

import antumbra.kernels.indexer_topk.triton as triton_kernels
from antumbra.kernels.indexer_topk import onepass
from antumbra.kernels.indexer_topk.reference import topk_rows_reference

POISON = -2
RANK_ALL = triton_kernels.TopkConfig(onepass_slice=64, rank_all=512, rank_own_max=0, rank_tie_block=16,
                                     rank_list_block=32)
RANK_OWN = triton_kernels.TopkConfig(onepass_slice=64, rank_all=0, rank_tie_block=16, rank_list_block=32)
CONFIGS = {"rank-all": RANK_ALL, "rank-own": RANK_OWN}


def _scores(case: str, rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    if case == "few-values":
        return torch.randint(0, 5, (rows, n), generator=gen).float()
    if case == "signed-zeros":
        scores = torch.zeros(rows, n)
        scores[:, ::2] = -0.0
        scores[0, :10] = torch.rand(10, generator=gen)
        return scores
    if case == "one-fp16-value":
        return 1.0 + torch.rand(rows, n, generator=gen) * 1e-4  # one coarse bucket: every valid one ties
    if case == "spread":
        return torch.randn(rows, n, generator=gen) * torch.tensor([1e-20, 1.0, 1e20])[:, None]
    return torch.randn(rows, n, generator=gen)


def _check(out: torch.Tensor, scores: torch.Tensor, cand: torch.Tensor, k: int,
           counts: torch.Tensor | None = None) -> None:
    ref = topk_rows_reference(scores, cand, k, counts)  # stable: the lowest index wins ties
    assert not (out == POISON).any(), "output left unwritten"
    for b in range(out.shape[0]):
        assert sorted(out[b].tolist()) == sorted(ref[b].tolist()), f"row {b}"
        position = {int(r): j for j, r in enumerate(cand[b].tolist())}
        picked = [position[int(r)] for r in out[b].tolist() if r >= 0]
        assert picked == sorted(picked), f"row {b}: not in candidate order"
        assert (out[b, len(picked):] == -1).all(), f"row {b}: padding"


def _run(scores: torch.Tensor, cand: torch.Tensor, k: int, config: triton_kernels.TopkConfig,
         counts: torch.Tensor | None = None, staged: bool = True,
         workspace: onepass.SelectWorkspace | None = None) -> tuple[torch.Tensor, onepass.SelectWorkspace]:
    rows, n = scores.shape
    if workspace is None:
        plan = onepass.plan_programs(rows, n, scores.device, config, staged=staged)
        assert plan is not None
        workspace = onepass.SelectWorkspace.allocate(rows, n, plan, "cpu", config.coarse_bits)
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    onepass.topk_rows(scores, cand, k, counts, out=out, workspace=workspace, config=config)
    assert not workspace.hist.any() and not workspace.counters.any(), "workspace left dirty"
    return out, workspace


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 buckets saturate
@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("case", ["few-values", "signed-zeros", "one-fp16-value", "spread", "normal"])
def test_staged_select_matches_the_reference(case: str, path: str) -> None:
    """Five programs a row: ties across programs resolve to the lowest indices, in candidate order;
    k below and above the valid count (row 2 has 20 valid candidates)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    rows, n = 3, 300
    cand = torch.stack([torch.randperm(1000, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    scores = _scores(case, rows, n, gen)
    cand[2, 20:] = -1
    for k in (7, 40):
        out, workspace = _run(scores, cand, k, CONFIGS[path])
        assert workspace.programs == 5
        _check(out, scores, cand, k)


@pytest.mark.parametrize("path", list(CONFIGS))
def test_one_launch_with_its_barriers_matches_the_reference(path: str) -> None:
    """The one-launch form (grid barriers) with one program a row, counts and holes included."""
    gen = torch.Generator().manual_seed(11)
    rows, n, k = 3, 200, 24
    cand = torch.stack([torch.randperm(600, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    cand[1, ::5] = -1
    scores = torch.randint(0, 40, (rows, n), generator=gen).float()  # ties inside the threshold bucket
    counts = torch.tensor([n, 150, 10], dtype=torch.int32)
    config = triton_kernels.TopkConfig(onepass_slice=256, rank_all=CONFIGS[path].rank_all, rank_own_max=0,
                                       rank_tie_block=16, rank_list_block=32)
    out, workspace = _run(scores, cand, k, config, counts, staged=False)
    assert workspace.programs == 1
    _check(out, scores, cand, k, counts)


def test_kept_workspace_gives_the_same_answer_again() -> None:
    gen = torch.Generator().manual_seed(5)
    rows, n, k = 2, 200, 32
    cand = torch.stack([torch.randperm(400, generator=gen)[:n] for _ in range(rows)]).to(torch.int32)
    counts = torch.tensor([n, 150], dtype=torch.int32)
    scores = torch.randint(0, 30, (rows, n), generator=gen).float()
    first, workspace = _run(scores, cand, k, RANK_OWN, counts)
    workspace.tie_keys.fill_(POISON)
    workspace.state.fill_(POISON)  # stale state from another call must not matter
    again, _ = _run(scores, cand, k, RANK_OWN, counts, workspace=workspace)
    assert torch.equal(first, again)
    _check(first, scores, cand, k, counts)


def test_rows_with_no_valid_candidate_are_all_padding() -> None:
    rows, n, k = 2, 100, 8
    cand = torch.full((rows, n), -1, dtype=torch.int32)
    cand[1, 3] = 7
    scores = torch.randn(rows, n)
    out, _ = _run(scores, cand, k, RANK_ALL)
    assert out[0].tolist() == [-1] * k and out[1].tolist() == [7] + [-1] * (k - 1)


def test_plan_takes_one_program_a_row_off_the_gpu_and_refuses_oversized_rows() -> None:
    cpu = torch.device("cpu")
    assert onepass.plan_programs(4, 1000, cpu) == (1, 1024)
    assert onepass.plan_programs(4, 1000, cpu, staged=True) == (4, 256)  # short rows: slices of 256
    assert onepass.plan_programs(1, 20000, cpu, staged=True) == (10, 2048)
    assert onepass.plan_programs(1, 5000, cpu) is None  # one program would hold more than SLICE_MAX
    small = triton_kernels.TopkConfig(onepass_slice=64)
    assert onepass.plan_programs(2, 1000, cpu, small, staged=True) == (16, 64)
