"""The fixed-shape decode path (Triton kernels, device-built indices, padded batches; CUDA
graphs on GPUs) against the engine's general path, on CPU with the kernels interpreted.

The same comparison runs on the H200 with graphs captured: `benchmarks/engine/slice.py`.
"""

from __future__ import annotations

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, EngineConfig, FastPathConfig, SchedulerConfig
from antumbra.replicas.model.fp8_linear import Fp8Linear
from antumbra.replicas.model.packed_experts import PackedExperts
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import TinyModelSpec, build_model, mtp_tensors
from antumbra.replicas.plan import PlanError, resolve_plan

MAX_MODEL_LEN = 1024
# Decodes that close C4 windows every 4 tokens and a C128 window at position 255, past
# the SWA window (128), with three rows padded to a graph size of 4.
PROMPTS = [list(range(3, 3 + n)) for n in (2, 126, 251)]
NUM_TOKENS = 7


def _engine(path, decode: str, **fast) -> Engine:
    return Engine.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=4),
        fast=FastPathConfig(decode=decode, cuda_graph_batch_sizes=(1, 4), **fast),
    )


def _generate(engine: Engine):
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    engine.check_integrity()
    return outs


def _assert_same(reference, fast) -> None:
    for ref, got in zip(reference, fast, strict=True):
        assert got.token_ids == ref.token_ids
        for want, have in zip(ref.logprobs, got.logprobs, strict=True):
            (token, value), = want.items()
            assert have[token] == pytest.approx(value, abs=1e-4)


def test_fast_decode_matches_the_general_path(tiny_checkpoint):
    reference = _generate(_engine(tiny_checkpoint, "off"))
    engine = _engine(tiny_checkpoint, "on")
    assert engine.runner.fast is not None
    engine.runner.fast.validate = True  # every step's new rows against the host's page tables
    fast = _generate(engine)
    _assert_same(reference, fast)
    # Every decode step after the prefill ran on the fast path.
    assert engine.runner.fast is not None
    assert engine.runner.fast.num_steps >= NUM_TOKENS - 1


def test_padded_rows_touch_nothing_live(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, "on")
    fast = engine.runner.fast
    assert fast is not None
    pools = engine.pools
    live_swa = pools.swa_kv[:, : pools.scratch_swa_row].clone()
    live_rows = {layer: p.rows[: p.scratch_row].clone() for layer, p in pools.compressors.items()}
    # All four rows inactive: a decode step of padding only.
    from antumbra.replicas.model.fast_decode import decode_step

    fast.inputs.active.fill_(0)
    fast.inputs.positions.fill_(255)
    # The step runs the model's own layers (one implementation for both steps): count their calls.
    calls: list[str] = []
    modules = [m for layer in engine.model.model.layers for m in (layer, layer.self_attn, layer.mlp)]
    record = lambda mod, args, out: calls.append(type(mod).__name__)  # noqa: E731
    hooks = [m.register_forward_hook(record) for m in modules]
    decode_step(engine.model, fast.inputs.head(4), pools, fast._shapes[4])
    for hook in hooks:
        hook.remove()
    assert sorted(calls) == sorted(type(m).__name__ for m in modules)
    assert torch.equal(pools.swa_kv[:, : pools.scratch_swa_row], live_swa)
    for layer, pool in pools.compressors.items():
        assert torch.equal(pool.rows[: pool.scratch_row], live_rows[layer])
    engine.check_integrity()


def test_the_general_path_is_kept_where_the_fast_one_does_not_apply(tiny_checkpoint):
    engine = _engine(tiny_checkpoint, "on")
    engine.core.add_request(PROMPTS[0], SamplingParams(max_tokens=3), want_prompt_logits=True)
    while engine.core.has_work():
        engine.core.step()
    assert engine.runner.fast.num_steps == 0  # prompt logits wanted: every step is general
    # HiSparse: "auto" keeps the general step on a CPU; "on" takes the fixed-shape one, which pages
    # rows in on the device (tests/replicas/test_hisparse.py); more than one rank is refused.
    hisparse = Engine.from_pretrained(tiny_checkpoint, cache=CacheConfig(hisparse_rows_per_request=64))
    assert hisparse.runner.fast is None
    on = Engine.from_pretrained(tiny_checkpoint, cache=CacheConfig(hisparse_rows_per_request=64),
                                fast=FastPathConfig(decode="on"))
    assert on.runner.fast is not None and on.pools.hot is not None
    with pytest.raises(PlanError, match="hisparse_rows_per_request"):
        resolve_plan(EngineConfig(cache=CacheConfig(hisparse_rows_per_request=64), tensor_parallel_size=2,
                                  fast=FastPathConfig(decode="on")))


def test_release_formats_stay_packed_and_match_their_dequantised_weights(tmp_path):
    spec = TinyModelSpec(seed=5)
    model = build_model(spec)
    path = save_release_checkpoint(model.state_dict(), model.config, tmp_path / "release",
                                   mtp_state_dict=mtp_tensors(spec))
    reference = _generate(_engine(path, "off", expert_format="dense", linear_format="dense"))
    engine = _engine(path, "on", expert_format="mxfp4", linear_format="fp8")
    layers = list(engine.model.model.layers)
    experts = [layer.mlp.experts for layer in layers]
    assert all(isinstance(e, PackedExperts) for e in experts)
    assert experts[0].w1.dtype == torch.int8  # 4 bits a weight, not a dequantised copy
    attn = layers[1].self_attn
    packed = [attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj, attn.compressor.indexer.q_b_proj,
              layers[1].mlp.shared_experts.down_proj]
    assert all(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn for m in packed)
    # The compressors' projections are bf16 in the release and stay dense.
    assert isinstance(attn.compressor.indexer.kv_proj, torch.nn.Linear)
    _assert_same(reference, _generate(engine))
