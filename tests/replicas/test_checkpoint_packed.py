"""Routed experts read from a release checkpoint's MXFP4 codes straight into `PackedExperts`.

The packed read never builds a dense expert tensor; its buffers hold the stored codes and scales,
which decode to exactly the weights the dense load gives, and an engine that keeps experts packed
loads them so. A checkpoint that stores its experts unquantised loads dense whatever is asked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from antumbra import Engine, SamplingParams
from antumbra.config import FastPathConfig, SchedulerConfig
from antumbra.replicas.build import load_model
from antumbra.replicas.model.checkpoint import expected_from_module, load_state_dict
from antumbra.replicas.model.moe import Experts
from antumbra.replicas.model.packed_experts import PackedExperts
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import TinyModelSpec, build_model

SPEC = TinyModelSpec(seed=9)
BUFFERS = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")


@pytest.fixture(scope="module")
def release_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_model(SPEC)
    return save_release_checkpoint(model.state_dict(), model.config, tmp_path_factory.mktemp("release"))


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m.experts for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_packed_read_gives_the_values_packing_the_dense_load_gives(release_checkpoint: Path) -> None:
    """Exactly the same weights; the bytes are the checkpoint's own (its writer may choose a larger scale
    for a group than packing picks, with codes to match)."""
    dense = load_model(release_checkpoint, "cpu", torch.float32, progress=False)
    packed = load_model(release_checkpoint, "cpu", torch.float32, progress=False, packed_experts=True)
    dense_experts, packed_experts = _experts_modules(dense.model), _experts_modules(packed.model)
    assert dense_experts and len(dense_experts) == len(packed_experts) == len(dense.model.model.layers)
    for want_dense, got in zip(dense_experts, packed_experts, strict=True):
        assert isinstance(want_dense, Experts) and isinstance(got, PackedExperts)
        want = PackedExperts.from_experts(want_dense)
        assert got.limit == want.limit
        for have, expect in zip(got.dense_weights(), want.dense_weights(), strict=True):
            assert torch.equal(have, expect)
    # Everything else loads as before.
    dense_state, packed_state = dense.model.state_dict(), packed.model.state_dict()
    for name, tensor in dense_state.items():
        if ".mlp.experts." not in name:
            assert torch.equal(packed_state[name], tensor), name


def test_the_packed_read_keeps_the_stored_codes_and_no_dense_expert_tensor(release_checkpoint: Path) -> None:
    model = build_model(SPEC)
    expected = expected_from_module(model)
    checkpoint = load_state_dict(release_checkpoint, expected, dtype=None, progress=False,
                                 packed_experts=True)
    merged = [k for k in expected if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    assert merged and not set(merged) & set(checkpoint.state_dict)
    assert sorted(checkpoint.packed_experts) == sorted({k.rpartition(".")[0] for k in merged})
    for buffers in checkpoint.packed_experts.values():
        assert sorted(buffers) == sorted(BUFFERS)
        assert buffers["w1"].dtype == torch.int8 and buffers["w1_scale"].dtype == torch.float8_e8m0fnu
    with safe_open(str(release_checkpoint / "model.safetensors"), framework="pt") as f:
        layer = checkpoint.packed_experts["model.layers.1.mlp.experts"]
        for proj in ("w1", "w3", "w2"):
            stored = f.get_tensor(f"layers.1.ffn.experts.2.{proj}.weight")
            stored_scale = f.get_tensor(f"layers.1.ffn.experts.2.{proj}.scale")
            assert torch.equal(_bytes(layer[proj][2]), _bytes(stored))
            assert torch.equal(_bytes(layer[f"{proj}_scale"][2]), _bytes(stored_scale))


def test_unquantised_experts_load_dense_when_packing_is_asked(tiny_checkpoint: Path) -> None:
    loaded = load_model(tiny_checkpoint, "cpu", torch.float32, progress=False, packed_experts=True)
    assert all(isinstance(m, Experts) for m in _experts_modules(loaded.model))


def test_an_engine_that_serves_packed_experts_reads_them_packed(release_checkpoint: Path) -> None:
    """On the CPU the packed kernels run interpreted: a few greedy tokens, against the dense experts."""
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = {}
    for fmt in ("mxfp4", "dense"):
        engine = Engine.from_pretrained(
            release_checkpoint, device="cpu", dtype="float32",
            scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=2),
            fast=FastPathConfig(decode="off", expert_format=fmt, linear_format="dense"), warmup="off")
        kinds = {type(m) for m in _experts_modules(engine.core.model)}
        assert kinds == ({PackedExperts} if fmt == "mxfp4" else {Experts})
        outs[fmt] = engine.generate([[5, 6, 7, 8]], params)[0]
        engine.check_integrity()
        engine.shutdown()
    assert outs["mxfp4"].token_ids == outs["dense"].token_ids
    for got, want in zip(outs["mxfp4"].logprobs, outs["dense"].logprobs, strict=True):
        (token, value), = want.items()
        assert abs(got[token] - value) < 1e-4
