"""The compression-state write kernel against its reference (the model's indexed stores).

Runs in the Triton interpreter on CPU, compiled where a CUDA device is present; the widening is
exact, so the state rows are compared bit for bit everywhere.
"""

from __future__ import annotations

import pytest
import torch

from antumbra.kernels.compressor import write_state, write_state_reference
from antumbra.kernels.compressor.state import write_state_constexprs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(tokens: int, width: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(tokens, width, generator=g).to(dtype).to(DEVICE)
    gate = torch.randn(tokens, width, generator=g).to(dtype).to(DEVICE)
    rows = torch.randperm(3 * tokens + 2, generator=g)[:tokens].to(DEVICE)
    state = torch.randn(3 * tokens + 2, width, generator=g).to(DEVICE)
    return kv, gate, rows, state


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 256), (5, 1024), (3, 160)], ids=lambda s: "x".join(map(str, s)))
def test_kernel_is_the_reference_bit_for_bit(shape, dtype):
    kv, gate, rows, state = _case(*shape, dtype, seed=shape[0] + shape[1])
    want_kv, want_gate = state.clone(), state.clone() + 1
    got_kv, got_gate = want_kv.clone(), want_gate.clone()
    write_state_reference(kv, gate, rows, want_kv, want_gate)
    write_state(kv, gate, rows, got_kv, got_gate)
    assert torch.equal(got_kv, want_kv) and torch.equal(got_gate, want_gate)
    untouched = torch.ones(state.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(got_kv[untouched], state[untouched])  # other rows keep their values


def test_padded_rows_may_share_a_scratch_row():
    kv, gate, rows, state = _case(4, 256, torch.bfloat16, seed=3)
    rows[:2] = torch.tensor([0, 1])
    rows[2:] = state.shape[0] - 1  # two padded rows, one scratch row
    got_kv, got_gate = state.clone(), state.clone()
    write_state(kv, gate, rows, got_kv, got_gate)
    assert torch.equal(got_kv[rows[:2]], kv[:2].float()) and torch.equal(got_gate[rows[:2]], gate[:2].float())
    assert any(torch.equal(got_kv[-1], kv[i].float()) for i in (2, 3))


def test_constexprs_follow_the_width_only():
    assert write_state_constexprs(1024) == dict(W=1024, BLOCK=512, num_warps=4)
    assert write_state_constexprs(160)["BLOCK"] == 256


def test_bad_inputs_are_refused():
    kv, gate, rows, state = _case(2, 128, torch.bfloat16, seed=1)
    with pytest.raises(AssertionError, match="one \\[T, W\\] shape and dtype"):
        write_state(kv, gate.float(), rows, state, state.clone())
    with pytest.raises(AssertionError, match="float32"):
        write_state(kv, gate, rows, state.double(), state.clone())
    with pytest.raises(AssertionError, match="integers"):
        write_state(kv, gate, rows.float(), state, state.clone())
    with pytest.raises(AssertionError, match="contiguous"):
        wide = torch.zeros(state.shape[0], 256, device=DEVICE)
        write_state(kv, gate, rows, wide[:, :128], state.clone())


@pytest.mark.gpu
def test_the_models_compressor_writes_through_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch):
    from types import SimpleNamespace

    from antumbra.replicas.model import compressor

    calls = []
    fused = compressor.write_state
    monkeypatch.setattr(compressor, "write_state", lambda *a: calls.append(1) or fused(*a))
    comp = compressor.WindowCompressor(hidden_size=64, head_dim=32, rate=4, overlap=2, eps=1e-6)
    comp = comp.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16, device="cuda")
    rows = torch.tensor([3, 0, 7, 2, 9], device="cuda")
    pool = SimpleNamespace(state_kv=torch.zeros(10, 64, device="cuda"),
                           state_gate=torch.zeros(10, 64, device="cuda"))
    with torch.no_grad():
        comp.write_state(x, rows, pool)
        want_kv, want_gate = comp.kv_proj(x).float(), comp.gate_proj(x).float()
    assert calls == [1]
    assert torch.equal(pool.state_kv[rows], want_kv) and torch.equal(pool.state_gate[rows], want_gate)
