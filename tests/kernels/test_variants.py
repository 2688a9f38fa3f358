"""Compiled-variant rules: the warm-up shapes reach every key a step within the limits can reach,
the general step launches exactly the keys `step_keys` predicts (interpreter, tiny model), request
sizes are never specialised, and `compile_watch` counts and chains through Triton's JIT hook."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import triton

from antumbra.kernels import variants
from antumbra.kernels.mhc.triton import mix_plan, split_pad
from antumbra.kernels.variants import VariantModel, step_keys, warm_keys, warmup_shapes

# V4-Flash (256 routed experts) and the 4-layer slice the H200 benchmarks run (16 experts).
V4_FLASH = VariantModel(
    hidden_size=4096, hc_mult=4, hc_sinkhorn_iters=20, num_heads=64, head_dim=512, rope_dim=64,
    sliding_window=128, has_sliding=True, csa_rate=4, hca_rate=128, index_topk=512, index_n_heads=64,
    index_head_dim=128, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, num_experts=256, top_k=6,
    moe_intermediate_size=2048,
)
V4_SLICE = VariantModel(**{**V4_FLASH.__dict__, "num_experts": 16})
# No sliding layer, a window under one key block, odd widths: the corners of the attention rules.
ODD = VariantModel(
    hidden_size=320, hc_mult=3, hc_sinkhorn_iters=5, num_heads=6, head_dim=96, rope_dim=16,
    sliding_window=48, has_sliding=False, csa_rate=4, hca_rate=64, index_topk=24, index_n_heads=5,
    index_head_dim=32, q_lora_rank=96, o_groups=2, o_lora_rank=48, num_experts=12, top_k=3,
    moe_intermediate_size=160,
)
LIMITS = [(8192, 65536, 64), (2048, 4096, 8), (3000, 5000, 3)]


def _probe_sizes(limit: int, rng: random.Random, count: int) -> list[int]:
    """Every power of two and its neighbours, the limit, and random sizes up to the limit."""
    sizes = {limit, 1}
    p = 1
    while p <= limit:
        sizes |= {v for v in (p - 1, p, p + 1) if 1 <= v <= limit}
        p *= 2
    sizes |= {rng.randint(1, limit) for _ in range(count)}
    return sorted(sizes)


@pytest.mark.parametrize("limits", LIMITS, ids=lambda lim: "x".join(map(str, lim)))
@pytest.mark.parametrize(("model", "num_sms"), [(V4_FLASH, 132), (V4_SLICE, 108), (ODD, 4)],
                         ids=["v4-flash-h200", "v4-slice-108sm", "odd-4sm"])
def test_every_reachable_key_is_warmed(model, num_sms, limits):
    max_tokens, max_len, max_seqs = limits
    shapes = warmup_shapes(max_tokens, max_len, max_seqs)
    warmed = warm_keys(shapes, model, num_sms)
    rng = random.Random(hash(limits) & 0xFFFF)
    tokens = _probe_sizes(max_tokens, rng, 40)
    lengths = _probe_sizes(max_len, rng, 40)
    near_rates = [m * j + e for m in (4, 64, 128) for j in (1, 2, 3) for e in (-1, 0, 1)]
    lengths += [length for length in near_rates if 1 <= length <= max_len]
    pairs = [(t, length) for t in tokens for length in lengths if t <= max_seqs * length]
    pairs += [(rng.randint(1, max_tokens), rng.randint(1, max_len)) for _ in range(300)]
    for t, length in pairs:
        if t > max_seqs * length:
            continue
        for family, keys in step_keys(model, t, length, num_sms).items():
            missing = keys - warmed
            assert not missing, f"T={t} L={length} {family}: {sorted(k for k, _ in missing)} not warmed"
    # The model-aware list is shorter and reaches the same keys.
    pruned = warmup_shapes(max_tokens, max_len, max_seqs, model=model, num_sms=num_sms)
    assert len(pruned) <= len(shapes) and warm_keys(pruned, model, num_sms) >= warmed


@pytest.mark.parametrize("limits", LIMITS + [(1, 1, 1), (7, 3, 2)], ids=lambda lim: "x".join(map(str, lim)))
def test_warmup_shapes_are_steps_within_the_limits(limits):
    max_tokens, max_len, max_seqs = limits
    shapes = warmup_shapes(max_tokens, max_len, max_seqs)
    assert shapes == sorted(set(shapes), key=lambda s: (s[1], s[0]))
    for t, length in shapes:
        assert 1 <= t <= max_tokens and 1 <= length <= max_len and t <= max_seqs * length
    assert max(t for t, _ in shapes) == min(max_tokens, max_seqs * max_len)
    assert max(length for _, length in shapes) == max_len


def test_warmup_shapes_of_the_serving_limits():
    """What the engine's warm-up runs at the two configurations the notes quote."""
    big = warmup_shapes(8192, 65536, 64)
    assert len(big) == 46 and (8192, 65536) in big and (64, 1) in big
    assert len(warmup_shapes(8192, 65536, 64, model=V4_FLASH, num_sms=132)) < 20
    assert len(warmup_shapes(2048, 4096, 8)) == 36


def test_finish_split_pad_bounds_every_token_count_of_its_bucket():
    k = 4 * 4096
    for num_sms in (4, 78, 132):
        for t in range(1, 5000):
            pad = split_pad(t, k, 64, num_sms)
            assert mix_plan(t, k, 64, num_sms)[1] <= pad
            assert pad == split_pad(triton.next_power_of_2(t), k, 64, num_sms)


def test_request_sizes_are_never_specialised():
    """Every name in a kernel's do_not_specialize is one of its parameters (a misspelt one
    would silently keep the specialisation)."""
    listed = 0
    for name, kernel in variants.triton_kernels():
        options = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps the jit options here
        names = options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or []
        assert set(names) <= set(kernel.arg_names), name
        listed += len(names)
    assert listed >= 20


def test_compile_watch_counts_and_chains(monkeypatch):
    from triton import knobs

    calls = []

    def previous(**kwargs):
        calls.append(kwargs["repr"])
        return None

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", previous)
    monkeypatch.setattr(variants, "interpreting", lambda: False)
    info = SimpleNamespace(name="_toy_kernel", module="antumbra.toy", jit_function=SimpleNamespace(
        arg_names=["x_ptr", "n", "BLOCK"]))
    compile_info = {
        "signature": {"x_ptr": "*bf16", "n": "constexpr", "BLOCK": "constexpr"},
        "constants": {(1,): 1, (2,): 64}, "configs": [{(0,): [["tt.divisibility", 16]]}],
        "num_warps": 4, "num_stages": 3,
    }
    with variants.compile_watch() as watch:
        hook = knobs.runtime.jit_cache_hook
        assert hook is not previous
        skipped = hook(key="k", repr="toy", fn=info, compile=compile_info, is_manual_warmup=False,
                       already_compiled=False)
    assert knobs.runtime.jit_cache_hook is previous and calls == ["toy"] and not skipped
    assert watch.count == 1 and watch.by_kernel() == {"_toy_kernel": 1}
    event = watch.events[0]
    assert event.constexprs == (("n", 1), ("BLOCK", 64)) and event.aligned == ("x_ptr",)
    assert "antumbra.toy._toy_kernel[warps=4, stages=3](n=1, BLOCK=64)" in watch.report()


def test_compile_watch_is_a_no_op_in_the_interpreter():
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    with variants.compile_watch() as watch:
        assert knobs.runtime.jit_cache_hook is before
    assert watch.count == 0 and watch.report() == "no compilation"


def test_indexer_without_closed_windows_picks_nothing():
    """A step whose sequences are all shorter than one C4 window has no candidate: nothing is
    launched (the kernel wants k >= 1) and no query gets a compressed key."""
    from antumbra.replicas.model.compressor import Indexer

    indexer = Indexer(16, 8, 2, 16, 4, 8, 1e-6)
    q, weights = torch.zeros(3, 2, 16), torch.zeros(3, 2)
    candidates, counts = torch.zeros(3, 0, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    rows = indexer.top_rows(q, weights, SimpleNamespace(rows=torch.zeros(0, 16)), candidates, counts)
    assert rows.shape == (3, 0) and rows.dtype == torch.int32


def _passed(key: variants.Key, launch: variants.Launch) -> bool:
    """The launch passed every constexpr of the key (the interpreter drops launch options)."""
    kernel, consts = key
    return kernel == launch.kernel and {kv for kv in consts if kv[0] not in ("num_warps", "num_stages")} <= (
        launch.constexprs
    )


@pytest.fixture(scope="module")
def short_window_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Every layer kind with a 16-token window and C16 entries: short steps reach every rule."""
    from antumbra.config import CSA, HCA
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    spec = TinyModelSpec(sliding_window=16, compress_rates={CSA: 4, HCA: 16})
    return make_tiny_checkpoint(tmp_path_factory.mktemp("short") / "model", spec)


def test_general_step_launches_the_predicted_variants(short_window_checkpoint, monkeypatch):
    """A real engine's general steps (prefill chunks, then a decode) under the interpreter: every
    launch is one `step_keys` predicts for the step's T and L, and every predicted variant but the
    compressors' (which launch only when a window closes) is launched."""
    from antumbra import Engine, SamplingParams
    from antumbra.config import FastPathConfig, SchedulerConfig

    engine = Engine.from_pretrained(
        short_window_checkpoint, device="cpu", dtype="float32",
        scheduler=SchedulerConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2),
        fast=FastPathConfig(decode="off", general_kernels="on"),
    )
    model = VariantModel.from_config(engine.model.config, fp8_linears=False, mxfp4_experts=False)
    steps = []
    forward = engine.model.forward

    def recorded(batch, pools):
        with variants.launch_recorder() as rec:
            out = forward(batch, pools)
        steps.append((batch.num_tokens, int(batch.positions.max()) + 1, rec.launches))
        return out

    monkeypatch.setattr(engine.model, "forward", recorded)
    engine.generate([list(range(5, 45))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    # chunks of 16, the rest (more C4 entries than the indexer picks), a decode
    assert [(t, length) for t, length, _ in steps] == [(16, 16), (16, 32), (8, 40), (1, 41)]
    for t, length, launches in steps:
        predicted = step_keys(model, t, length, 4, on_gpu=False)
        every = set().union(*predicted.values())
        for launch in launches:
            assert any(_passed(key, launch) for key in every), (t, length, launch)
        for family, keys in predicted.items():
            for key in keys if family != "compressor" else ():
                assert any(_passed(key, launch) for launch in launches), (t, length, key[0])
    first = {launch.kernel for launch in steps[0][2]}
    assert first >= {"_compress_kernel", "_topk_filter_kernel", "_hybrid_split_kernel", "_pre_finish_kernel"}
