"""FP8-block linear kernels vs the reference, in the Triton interpreter on CPU.

Weights come from `replicas.model.quant.quant_fp8_block` on random float weights whose 128 x 128
blocks are rescaled by different powers of two, so every block has its own exponent. Shapes are
small and irregular: K and N not multiples of 128 (partial scale blocks, partial tiles and steps),
several row and column blocks of scales, K slices whose last steps run past K. Outputs, split-K
workspaces and the dense path's dequantised scratch are NaN-poisoned, so an element a kernel never
writes fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from antumbra.kernels.common.arrivals import MIN_COUNTERS, arrival_counters
from antumbra.kernels.fp8_linear import (
    DECODE_16_CONFIG,
    DENSE_MIN_TOKENS,
    DEQUANT_CONFIG,
    DEQUANT_SWEEP,
    FP8_BLOCK,
    GEMV_CONFIG,
    MID_CONFIG,
    PREFILL_CONFIG,
    Fp8DequantConfig,
    Fp8LinearConfig,
    dequant_fp8_into,
    fp8_linear,
    fp8_linear_pair,
    fp8_linear_reference,
    pick_config,
    split_count,
    uses_dense,
)
from antumbra.kernels.fp8_linear import triton as fp8_triton
from antumbra.kernels.fp8_linear.reference import dequant_fp8_weight
from antumbra.replicas.model.quant import dequant_fp8_block, quant_fp8_block


def _nan_empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_triton, "_empty", _nan_empty)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _weight(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float8_e8m0fnu [ceil(N/128), ceil(K/128)]) with one exponent per block."""
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    block_scale = torch.randint(-6, 4, (rows, cols), generator=g).float().exp2()
    spread = block_scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return quant_fp8_block(0.05 * torch.randn(n, k, generator=g) * spread)


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    ref = fp8_linear_reference(x.float(), w, s)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert out.isfinite().all(), "kernel left outputs unwritten"
    # float32 accumulation: only the order of the sums differs; otherwise the output rounding
    tol = 1e-5 if x.dtype == torch.float32 else 4e-3
    assert _rel_err(out, ref) < tol


GEMV_SMALL = Fp8LinearConfig(block_t=1, block_n=16, block_k=64)


@pytest.mark.parametrize(
    ("config", "tokens", "k", "n", "dtype", "scale_u8"),
    [
        # CUDA-core GEMV: K and N tails, one scale per step
        (GEMV_SMALL, 1, 200, 72, torch.float32, False),
        (GEMV_SMALL, 3, 200, 72, torch.bfloat16, True),
        (GEMV_SMALL, 17, 200, 72, torch.float32, True),
        # steps wider than a scale block (a scale per column), three row blocks of scales
        (Fp8LinearConfig(block_t=1, block_n=32, block_k=256), 2, 300, 264, torch.float32, True),
        # 3 K slices of 2 steps over 5 steps: the last slice's second step lies past K
        (Fp8LinearConfig(block_t=1, block_n=8, block_k=64, split_k=3), 1, 300, 72, torch.float32, False),
        # tensor cores, each step's product scaled: padded token tile, K and N tails
        (Fp8LinearConfig(block_t=16, block_n=32, block_k=64), 17, 200, 72, torch.float32, False),
        (Fp8LinearConfig(block_t=16, block_n=32, block_k=64), 1, 200, 72, torch.bfloat16, True),
        (Fp8LinearConfig(block_t=16, block_n=32, block_k=64, split_k=2), 130, 200, 72, torch.bfloat16, False),
        # tensor cores, the weight tile scaled; several token tiles, row blocks of scales
        (
            Fp8LinearConfig(block_t=16, block_n=64, block_k=128, scale_weights=True),
            130,
            200,
            200,
            torch.bfloat16,
            False,
        ),
        (
            Fp8LinearConfig(block_t=32, block_n=128, block_k=32, scale_weights=True, split_k=2),
            3,
            200,
            72,
            torch.float32,
            True,
        ),
        # fp16 activations always scale the product
        (
            Fp8LinearConfig(block_t=16, block_n=16, block_k=64, scale_weights=True),
            5,
            72,
            40,
            torch.float16,
            False,
        ),
        # multiples of the scale block and of the tiles
        (
            Fp8LinearConfig(block_t=16, block_n=64, block_k=128, scale_weights=True),
            17,
            256,
            256,
            torch.float32,
            True,
        ),
        (GEMV_SMALL, 1, 256, 128, torch.bfloat16, False),
    ],
)
def test_kernel_matches_reference(config, tokens, k, n, dtype, scale_u8):
    g = torch.Generator().manual_seed(tokens * 1000 + k + n)
    w, s = _weight(g, n, k)
    if scale_u8:
        s = s.view(torch.uint8)  # raw exponent bytes are accepted too
    x = torch.randn(tokens, k, generator=g).to(dtype)
    _check(fp8_linear(x, w, s, config=config), x, w, s)


def test_auto_config_leading_dims_and_strided_rows():
    """[B, S, K] input through `pick_config`; rows of a wider buffer (row stride != K)."""
    g = torch.Generator().manual_seed(7)
    w, s = _weight(g, 72, 200)
    x = torch.randn(2, 3, 200, generator=g)
    out = fp8_linear(x, w, s)
    assert out.shape == (2, 3, 72)
    _check(out.reshape(6, 72), x.reshape(6, 200), w, s)
    wide = torch.randn(2, 256, generator=g)
    _check(fp8_linear(wide[:, :200], w, s, config=GEMV_SMALL), wide[:, :200], w, s)


def test_extreme_exponents():
    """Exponent bytes over a wide range, byte 0 (2^-127, a float32 subnormal) included."""
    g = torch.Generator().manual_seed(8)
    n, k = 140, 260
    w = quant_fp8_block(torch.randn(n, k, generator=g))[0]
    exps = torch.randint(100, 150, (2, 3), generator=g, dtype=torch.uint8)
    exps[0, 0] = 0
    x = torch.randn(3, k, generator=g)
    ref = fp8_linear_reference(x, w, exps)
    assert torch.equal(dequant_fp8_block(w, exps), dequant_fp8_block(w, exps.view(torch.float8_e8m0fnu)))
    for config in (GEMV_SMALL, Fp8LinearConfig(block_t=16, block_n=32, block_k=64, scale_weights=True)):
        out = fp8_linear(x, w, exps, config=config)
        assert out.isfinite().all() and _rel_err(out, ref) < 1e-5


def test_pick_config_and_split_count():
    assert pick_config(1) == GEMV_CONFIG and pick_config(16) == DECODE_16_CONFIG
    # prefill: 256-token tiles unless they would leave multiprocessors without an output tile
    assert pick_config(2048, 32768, num_sms=132) == PREFILL_CONFIG
    assert pick_config(2048, 1024, num_sms=132) == MID_CONFIG == pick_config(256)
    for tokens in (1, 2, 16, 17, 64, 65, 512, 4096):
        config = pick_config(tokens)
        assert config.block_t == 1 or config.block_t >= min(tokens, 64)
    # a full wave of output tiles is not split; a few tiles are, within min_split_cols per slice
    assert split_count(DECODE_16_CONFIG, 8, 32768, 1024, num_sms=132) == 1
    splits = split_count(DECODE_16_CONFIG, 8, 1024, 4096, num_sms=132)
    assert 1 < splits <= 4096 // DECODE_16_CONFIG.min_split_cols
    # explicit splits are capped by the steps and never leave a slice empty
    for k, block_k, wanted in ((300, 64, 3), (300, 64, 7), (1000, 128, 4), (64, 64, 5)):
        config = Fp8LinearConfig(block_t=1, block_n=16, block_k=block_k, split_k=wanted)
        splits = split_count(config, 1, 72, k, num_sms=4)
        steps = -(-k // block_k)
        per_slice = -(-steps // splits)
        assert 1 <= splits <= steps and (splits - 1) * per_slice < steps


def test_empty_batch():
    g = torch.Generator().manual_seed(9)
    w, s = _weight(g, 72, 200)
    out = fp8_linear(torch.empty(0, 200), w, s)
    assert out.shape == (0, 72)


def test_reference_dequantisation_is_the_models():
    g = torch.Generator().manual_seed(3)
    w, scale = quant_fp8_block(torch.randn(200, 300, generator=g))
    torch.testing.assert_close(dequant_fp8_weight(w, scale), dequant_fp8_block(w, scale), rtol=0, atol=0)
    torch.testing.assert_close(
        dequant_fp8_weight(w, scale.view(torch.uint8)), dequant_fp8_block(w, scale), rtol=0, atol=0
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN-free comparisons are bit for bit (signed zeros too)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# The interpreter turns float32 into bf16 by truncation and mishandles float32 subnormals, neither of
# which an exact dequantisation meets while its outputs stay normal: bf16 cases use exponent bytes
# 100..150. float32 cases add byte 0 (2^-127, a subnormal scale).
@pytest.mark.parametrize(
    ("n", "k", "dtype", "config"),
    [
        (200, 300, torch.bfloat16, DEQUANT_CONFIG),  # ragged rows, columns and scale blocks
        (72, 200, torch.bfloat16, Fp8DequantConfig(block_n=16, block_k=512)),  # one tile wider than K
        (256, 384, torch.bfloat16, Fp8DequantConfig(block_n=128, block_k=64, num_warps=8)),  # half a block
        (140, 260, torch.float32, Fp8DequantConfig(block_n=8, block_k=16)),  # many tiny tiles
        (140, 260, torch.float32, DEQUANT_CONFIG),
        (130, 130, torch.float16, DEQUANT_CONFIG),
    ],
)
def test_dequant_kernel_is_exact(n, k, dtype, config):
    g = torch.Generator().manual_seed(n * k)
    w, s = _weight(g, n, k)
    exps = torch.randint(100, 151, s.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    if dtype == torch.float32:
        exps[0, 0] = 0
    elif dtype == torch.float16:  # fp16 is exact for scales 2^-15 .. 2^7 only
        exps = torch.randint(113, 134, s.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    out = torch.full((n, k), float("nan"), dtype=dtype)
    assert dequant_fp8_into(out, w, exps, config) is out
    assert torch.equal(_bits(out), _bits(dequant_fp8_weight(w, exps, dtype)))
    assert torch.equal(_bits(out), _bits(dequant_fp8_block(w, exps).to(dtype)))  # the model's decode


def test_every_dequant_tile_is_exact():
    """Each tile the benchmark sweeps, on e8m0 scales, at a shape with partial tiles for all of them."""
    g = torch.Generator().manual_seed(11)
    w, s = _weight(g, 200, 600)
    ref = _bits(dequant_fp8_weight(w, s, torch.bfloat16))
    for config in DEQUANT_SWEEP:
        out = torch.full((200, 600), float("nan"), dtype=torch.bfloat16)
        assert torch.equal(_bits(dequant_fp8_into(out, w, s, config)), ref), config


@pytest.mark.parametrize(
    ("shape", "dtype", "config"),
    [
        ((17, 300), torch.bfloat16, DEQUANT_CONFIG),
        ((2, 3, 300), torch.float32, Fp8DequantConfig(block_n=64, block_k=128)),
        ((5, 300), torch.float16, DEQUANT_CONFIG),
    ],
)
def test_dense_path_matches_reference(shape, dtype, config):
    """A dequantisation config forces the dense path (dequantise into a scratch, then torch.mm)."""
    g = torch.Generator().manual_seed(12)
    w, s = _weight(g, 200, 300)
    x = torch.randn(*shape, generator=g).to(dtype)
    out = fp8_linear(x, w, s, config=config)
    assert out.shape == (*shape[:-1], 200)
    _check(out.reshape(-1, 200), x.reshape(-1, 300), w, s)
    wide = torch.randn(4, 384, generator=g).to(dtype)  # rows of a wider buffer
    _check(fp8_linear(wide[:, :300], w, s, config=config), wide[:, :300], w, s)
    assert fp8_linear(torch.empty(0, 300, dtype=dtype), w, s, config=config).shape == (0, 200)


def test_uses_dense_only_for_bf16_prefill_on_cuda():
    half = DENSE_MIN_TOKENS // 2
    assert uses_dense(DENSE_MIN_TOKENS, torch.bfloat16, "cuda")
    assert uses_dense(8 * DENSE_MIN_TOKENS, torch.bfloat16, "cuda")
    # the decision is per power-of-two bucket, like pick_config's: a bucket runs one path
    assert uses_dense(half + 1, torch.bfloat16, "cuda") and not uses_dense(half, torch.bfloat16, "cuda")
    assert not uses_dense(1, torch.bfloat16, "cuda") and not uses_dense(0, torch.bfloat16, "cuda")
    for dtype in (torch.float16, torch.float32):  # fp16: a dequantised fp16 weight is not exact
        assert not uses_dense(DENSE_MIN_TOKENS, dtype, "cuda")
    assert not uses_dense(DENSE_MIN_TOKENS, torch.bfloat16, "cpu")


def test_default_config_follows_uses_dense(monkeypatch: pytest.MonkeyPatch):
    """config None takes the dense path exactly when `uses_dense` says so; a Triton config never."""
    g = torch.Generator().manual_seed(13)
    w, s = _weight(g, 72, 200)
    x = torch.randn(3, 200, generator=g).to(torch.bfloat16)
    calls = []
    dense = fp8_triton.dense_linear
    monkeypatch.setattr(fp8_triton, "dense_linear", lambda *args: calls.append(args[3]) or dense(*args))
    monkeypatch.setattr(fp8_triton, "uses_dense", lambda num_tokens, dtype, device_type: True)
    _check(fp8_linear(x, w, s), x, w, s)
    assert calls == [DEQUANT_CONFIG]
    _check(fp8_linear(x, w, s, config=GEMV_SMALL), x, w, s)
    monkeypatch.setattr(fp8_triton, "uses_dense", lambda num_tokens, dtype, device_type: False)
    _check(fp8_linear(x, w, s), x, w, s)
    assert calls == [DEQUANT_CONFIG]


@pytest.mark.gpu
@pytest.mark.parametrize("triton_tiles", [False, True], ids=["default", "triton"])
@pytest.mark.parametrize("tokens", [130, 384, 2048])
def test_repeated_calls_on_a_gpu_are_bitwise_equal(tokens, triton_tiles):
    """A compiled tile that is sometimes wrong (a pipelining race) shows as calls on one input that
    differ. This runs on a GPU only (`@pytest.mark.gpu`).
    `triton_tiles`: the Triton launch shape of T even where the default is the dense path."""
    k, n = 8192, 4096  # V4-Flash o_b: split-K at these token counts
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w, exps = quant_fp8_block(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = fp8_triton.plan(tokens, n, k, num_sms)[0] if triton_tiles else None
    first = fp8_linear(x, w, exps, config=config)
    ref = F.linear(x.float(), dequant_fp8_weight(w, exps)).to(torch.bfloat16)
    assert _rel_err(first, ref) < 1e-2
    assert all(torch.equal(fp8_linear(x, w, exps, config=config), first) for _ in range(40))


@pytest.mark.parametrize(
    ("config", "tokens"),
    [(Fp8LinearConfig(block_t=1, block_n=32, block_k=64, split_k=3), 2),
     (Fp8LinearConfig(block_t=16, block_n=32, block_k=32, scale_weights=True, split_k=4), 20)],
    ids=["gemv", "dot"],
)
def test_the_last_slice_to_arrive_sums_the_slices_in_order(config, tokens, monkeypatch):
    """With split-K, each output tile is finished by whichever of its programs arrives last: the sum
    is the slices' in order 0, 1, ... (bit for bit, whatever the arrival order), and every arrival
    counter of the stream is back at zero afterwards, so the next call needs no fill."""
    workspaces: list[torch.Tensor] = []

    def recorded(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = _nan_empty(*shape, dtype=dtype, device=device)
        workspaces.append(t)
        return t

    monkeypatch.setattr(fp8_triton, "_empty", recorded)
    g = torch.Generator().manual_seed(5)
    k, n = 300, 72  # partial tiles, partial steps, three rows of scales
    w, s = _weight(g, n, k)
    x = torch.randn(tokens, k, generator=g)
    y = fp8_linear(x, w, s, config=config)
    _check(y, x, w, s)
    partial = workspaces[-1]
    assert partial.shape[0] == config.split_k
    in_order = torch.zeros(tokens, n)
    for part in partial:  # [T, whole tiles of columns]
        in_order += part[:, :n]
    assert torch.equal(y, in_order)
    tiles = -(-tokens // config.block_t) * -(-n // config.block_n)
    assert not arrival_counters(x.device, tiles).any()
    assert torch.equal(fp8_linear(x, w, s, config=config), y)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_split_decode_calls_on_a_gpu_repeat_and_replay_in_a_graph(tokens):
    """Decode sizes that split K (V4-Flash's q_a and o_b at one token, wq_b at 8 and 16): repeated
    calls are bitwise equal and leave the stream's counters at zero, and a CUDA graph of the call
    replays to the eager result. On a GPU only (`@pytest.mark.gpu`)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((1024, 4096), (4096, 8192)):
        w, exps = quant_fp8_block(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
        config, split = fp8_triton.plan(tokens, n, k, num_sms)
        assert split > 1, (n, k, tokens)
        first = fp8_linear(x, w, exps)
        ref = F.linear(x.float(), dequant_fp8_weight(w, exps)).to(torch.bfloat16)
        assert _rel_err(first, ref) < 1e-2
        assert all(torch.equal(fp8_linear(x, w, exps), first) for _ in range(20))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fp8_linear(x, w, exps)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_linear(x, w, exps)
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, first)
        assert not arrival_counters(x.device, MIN_COUNTERS).any()  # the stream's whole first buffer


@pytest.mark.parametrize(("tokens", "k", "n1", "n2"),
                         [(1, 600, 200, 72), (1, 2304, 96, 40), (3, 300, 64, 72)],
                         ids=["tails", "split", "rows"])
def test_a_pair_is_two_linears(tokens, k, n1, n2):
    """Two FP8 linears on one input (q_a and kv; the shared expert's gate and up): one GEMV launch at
    one row (tile tails in both weights, a K split), two calls at several."""
    g = torch.Generator().manual_seed(k + n1)
    (w1, s1), (w2, s2) = _weight(g, n1, k), _weight(g, n2, k)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    y1, y2 = fp8_linear_pair(x, (w1, s1), (w2, s2))
    _check(y1, x, w1, s1)
    _check(y2, x, w2, s2)
    assert not arrival_counters(x.device, MIN_COUNTERS).any()


@pytest.mark.gpu
def test_pairs_at_v4_shapes_on_a_gpu_match_and_replay():
    """q_a with kv (4096 -> 1024 + 512) and the shared expert's gate with up (4096 -> 2048 + 2048) at
    one token: against the reference, repeated calls and a graph's replays bitwise the first call."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for n1, n2 in ((1024, 512), (2048, 2048)):
        (w1, s1), (w2, s2) = (quant_fp8_block(torch.randn(n, 4096, device="cuda", generator=g) * 0.02)
                              for n in (n1, n2))
        x = torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16)
        first = fp8_linear_pair(x, (w1, s1), (w2, s2))
        for y, w, s in zip(first, (w1, w2), (s1, s2), strict=True):
            assert _rel_err(y, F.linear(x.float(), dequant_fp8_weight(w, s)).to(torch.bfloat16)) < 1e-2
        again = fp8_linear_pair(x, (w1, s1), (w2, s2))
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_linear_pair(x, (w1, s1), (w2, s2))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, first, strict=True))
