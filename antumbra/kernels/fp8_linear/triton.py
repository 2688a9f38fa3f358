"""Dense linear with an FP8-block weight dequantised in-kernel (see `reference.py` for the math).

`y [T, N] = x [T, K] @ W^T` with W stored as e4m3 values [N, K] and one UE8M0 exponent byte per
128 x 128 block. The weight is read once as bytes and never materialised in a wider type.

Two kernels, picked by the token tile (`Fp8LinearConfig.block_t`):

* `_gemv_kernel` (`block_t == 1`, decode at batch 1): one program per (token, `block_n` weight rows,
  K slice). Each step loads a `[block_n, block_k]` tile of e4m3 bytes (rows are contiguous: 16-byte
  loads), converts it to float32 and multiply-adds it with the step's activations into a
  `[block_n, block_k]` float32 accumulator on the CUDA cores; the rows are summed across threads
  once, after the loop. The block scale is folded into the activations (`block_k` multiplies a step,
  not `block_n * block_k`). At several tokens each one re-reads the weights (from L2 at best), so on
  an H200 the tensor-core kernel is already faster at 4 tokens.
  Two linears that read the same input (q_a and kv; the shared expert's gate and up) share a launch
  (`fp8_linear_pair`): the first weight's output tiles, then the second's, each program one weight's.
* `_dot_kernel` (`block_t >= 16`): a `[block_n, block_t]` output tile per program, accumulated on
  the tensor cores with the weight as the M operand and the tokens as N ("swap AB": a few tokens
  waste only the padded columns of the activation tile). The e4m3 tile is converted to the dot dtype
  (bf16 for bf16 activations, fp16 for fp16, float32 otherwise). The scale goes either
  - on the weight tile before the dot (`scale_weights`; faster on an H200 at most shapes measured): the
    converted weights feed the matrix unit from registers and the accumulator chains through the
    loop; or
  - on each step's product (`acc += dot(w, x) * s`): the weight tile is loaded from shared memory
    straight into the dot-operand layout (a multiply before the dot adds a layout shuffle), but each
    step waits for its own matrix product.
  Scales are powers of two and an e4m3 value has 4 significant bits, so scaling the weights is exact
  in bf16 and float32; in fp16 it would not be for scales below 2^-15, so fp16 always scales the
  product. Either way the result differs from the reference only by the order of float32 sums.

Scale lookups: `block_n` divides 128, so a tile's rows share one row of scales; a step of
`block_k <= 128` columns (which divides 128) shares one scale, a wider GEMV step loads one per
column. The bytes are too narrow for the pipeliner's async copies, so each step's scales are loaded
one step ahead by hand.

Split-K: when the output tiles alone do not fill the chip (N = 1024 at decode is 16 tiles of 64
rows), the K range is cut into slices; each program writes a float32 partial of its output tile
into a workspace and counts its arrival at the tile's counter (`common.arrivals`); the last of the
tile's programs to arrive adds the slices in a fixed order (0, 1, ..., whichever program that is)
and casts. Deterministic, one launch, no fill: the finishing program sets the counter back to
zero. Shapes that already give a wave of tiles are not split (measured slower).

Prefill sizes (`uses_dense`: bf16 on a CUDA device, T rounded up to a power of two at least
DENSE_MIN_TOKENS) take neither kernel: the weight is expanded once into a bf16 scratch (`dequant.py`,
exact) and multiplied by cuBLAS, which runs near the bf16 tensor-core rate, where `_dot_kernel`
reaches 0.4-0.8 of it at 2048 tokens. The expansion reads 1 byte and writes 2 per weight: at the
H200's copy bandwidth and bf16 rate, about 15% of the GEMM's time at 2048 tokens and 4% at 8192.

Every allocation is `torch.empty` of a size fixed by the shapes and the config, and the launch reads
nothing from the device, so calls can be captured in CUDA graphs.

`benchmarks/kernels/fp8_linear.py` times each launch shape at the V4-Flash projections against
F.linear on a bf16 copy of the weight and against dequantise-then-F.linear: the kernels win at decode
sizes, cuBLAS on the expanded weight at prefill sizes, which is where `DENSE_MIN_TOKENS` puts the
switch. TUNING.md keeps the figures.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.arrivals import arrival_counters, store_split_tile, tile_slots
from antumbra.kernels.common.codecs import e8m0_to_f32
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import interpreting, prepare

from .dequant import DEQUANT_CONFIG, Fp8DequantConfig, dequant_fp8_into

SCALE_BLOCK = 128  # rows and columns of weight per UE8M0 scale
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocation of float outputs and workspaces; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Launch shape of one call."""

    block_t: int  # tokens per program: 1 = CUDA-core GEMV (`_gemv_kernel`), >= 16 = tensor cores
    block_n: int  # weight rows (output channels) per program: a power of two dividing 128
    block_k: int  # reduction columns per step: a power of two (16..128 with the tensor cores)
    num_warps: int = 4
    num_stages: int = 3  # software-pipeline depth of the reduction loop
    split_k: int = 0  # K slices summed by a second launch; 0 = chosen from the shape (`split_count`)
    programs_per_sm: int = 2  # auto split-K aims for this many programs per multiprocessor
    min_split_cols: int = 512  # auto split-K never gives a slice fewer reduction columns
    scale_weights: bool = False  # tensor cores: scale the weight tile, not each step's product (not fp16)


GEMV_CONFIG = Fp8LinearConfig(
    block_t=1, block_n=32, block_k=256, num_warps=4, num_stages=3, min_split_cols=1024
)
DECODE_16_CONFIG = Fp8LinearConfig(
    block_t=16, block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4, scale_weights=True
)
DECODE_32_CONFIG = dataclasses.replace(DECODE_16_CONFIG, block_t=32)
DECODE_64_CONFIG = dataclasses.replace(DECODE_16_CONFIG, block_t=64)
# Two stages, not three: Triton 3.6 compiled this tile at three stages into a kernel that on the
# H200 now and then left one program's output tile wrong on a repeated call with the same input
# (TUNING.md); at two stages every call is bitwise the first, which a GPU-marked test checks.
MID_CONFIG = Fp8LinearConfig(
    block_t=128, block_n=128, block_k=64, num_warps=8, num_stages=2, scale_weights=True
)
PREFILL_CONFIG = Fp8LinearConfig(
    block_t=256, block_n=128, block_k=64, num_warps=8, num_stages=4, scale_weights=True
)


def pick_config(num_tokens: int, n: int = 0, num_sms: int = 0) -> Fp8LinearConfig:
    """The launch shape for T tokens: the GEMV at 1, the narrowest token tile that holds them up to
    64, then 128-token tiles, and 256-token tiles past 512 tokens when those still give every one of
    `num_sms` multiprocessors an output tile of the N outputs (n = 0: assume they do). `fp8_linear`
    asks for next_power_of_2(T): each threshold is then a bucket boundary."""
    if num_tokens <= 1:
        return GEMV_CONFIG
    if num_tokens <= 16:
        return DECODE_16_CONFIG
    if num_tokens <= 32:
        return DECODE_32_CONFIG
    if num_tokens <= 64:
        return DECODE_64_CONFIG
    wide_tiles = (host_math.cdiv(num_tokens, PREFILL_CONFIG.block_t)
                  * host_math.cdiv(n, PREFILL_CONFIG.block_n))
    if num_tokens <= 512 or (n and wide_tiles < num_sms):
        return MID_CONFIG
    return PREFILL_CONFIG


@functools.lru_cache(maxsize=16)
def split_count(config: Fp8LinearConfig, num_tokens: int, n: int, k: int, num_sms: int) -> int:
    """K slices for this call: about `config.split_k`; else none when the output tiles fill a wave,
    otherwise just enough to give every SM `programs_per_sm` programs with at least `min_split_cols`
    columns per slice. Never more than the number of `block_k` steps, each slice whole steps."""
    tiles = host_math.cdiv(num_tokens, config.block_t) * host_math.cdiv(n, config.block_n)
    return host_math.split_k_slices(tiles, k, config.block_k, num_sms, config.programs_per_sm,
                                    config.min_split_cols, config.split_k)


@triton.jit
def _step_scales(s_row, k0, K, BLOCK_K: tl.constexpr):
    """float32 scales of the columns [k0, k0 + BLOCK_K) of one scale row: a scalar when BLOCK_K <= 128
    (the step lies inside one 128-column block), else [BLOCK_K]. Steps at or past K read the row's
    last scale (a slice's steps may run past K; those loads must stay inside the row)."""
    if BLOCK_K <= _SCALE_BLOCK:
        s = e8m0_to_f32(tl.load(s_row + tl.minimum(k0, K - 1) // _SCALE_BLOCK))
    else:
        cols = tl.minimum(k0 + tl.arange(0, BLOCK_K), K - 1)
        s = e8m0_to_f32(tl.load(s_row + cols // _SCALE_BLOCK))
    return s


# The token count and the steps per K slice (which follow the split, a function of T) are not
# specialised: they bound masks and loops. N, K and the row stride are the linear's widths and
# keep their divisibility hints (vector loads of weight and activation rows).
@triton.jit(do_not_specialize=["num_tokens", "k_steps"])
def _gemv_kernel(
    x_ptr,  # *T [T, K] activations, unit stride along K
    w_ptr,  # *e4m3 [N, K] weight, contiguous
    s_ptr,  # *u8 [ceil(N/128), ceil(K/128)] exponents, contiguous
    out_ptr,  # out: *T [T, N], contiguous (written with one K slice)
    w2_ptr,  # *e4m3 [N2, K] a second weight on the same input (w again when N2 = 0)
    s2_ptr,  # *u8 its exponents
    out2_ptr,  # out: *T [T, N2], contiguous
    part_ptr,  # out: *f32 [SPLIT, T, tiles * BLOCK_N] partial sums, contiguous (with several slices)
    count_ptr,  # *i32 [T * tiles] arrival counters, zero, left zero (with several slices)
    num_tokens,
    N,
    N2,
    K,
    stride_x,  # elements between activation rows
    k_steps,  # BLOCK_K steps per K slice
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # its loads feed no tl.dot, so the kernel-wide num_stages would not apply
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    # The first weight's tiles, then the second's: a tile never straddles them.
    tiles1 = tl.cdiv(N, BLOCK_N)
    if pid_n < tiles1:
        w_base = w_ptr
        s_base = s_ptr
        o_base = out_ptr
        n = N
        n0 = pid_n * BLOCK_N
    else:
        w_base = w2_ptr
        s_base = s2_ptr
        o_base = out2_ptr
        n = N2
        n0 = (pid_n - tiles1) * BLOCK_N
    rows = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    w_rows = w_base + rows.to(tl.int64)[:, None] * K
    s_row = s_base + (n0 // _SCALE_BLOCK) * tl.cdiv(K, _SCALE_BLOCK)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    k_first = split * k_steps * BLOCK_K
    # Scale bytes are too narrow for the pipeliner's async copies: each step's are loaded one step
    # ahead by hand, so their latency hides behind the current step.
    s_next = _step_scales(s_row, k_first, K, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i in tl.range(0, k_steps, num_stages=STAGES):
        k0 = k_first + i * BLOCK_K
        s = s_next
        s_next = _step_scales(s_row, k0 + BLOCK_K, K, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * (x * s)[None, :]
    slots, slice_stride = tile_slots(t, pid_n, num_tokens, BLOCK_N)
    out_ptrs = o_base + t.to(tl.int64) * n + rows
    store_split_tile(tl.sum(acc, axis=1), out_ptrs, part_ptr + slots, row_ok, slice_stride,
                     count_ptr + t * tl.num_programs(1) + pid_n, out_ptrs.dtype.element_ty, 1.0)


@triton.jit(do_not_specialize=["num_tokens", "k_steps"])
def _dot_kernel(
    x_ptr,  # *T [T, K] activations, unit stride along K
    w_ptr,  # *e4m3 [N, K] weight, contiguous
    s_ptr,  # *u8 [ceil(N/128), ceil(K/128)] exponents, contiguous
    out_ptr,  # out: *T [T, N], contiguous (written with one K slice)
    part_ptr,  # out: *f32 [SPLIT, T, tiles * BLOCK_N] partial sums, contiguous (with several slices)
    count_ptr,  # *i32 [T / BLOCK_T * N / BLOCK_N] arrival counters, as in `_gemv_kernel`
    num_tokens,
    N,
    K,
    stride_x,
    k_steps,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides 128: one scale per step
    DT: tl.constexpr,  # dot operand dtype
    SCALE_W: tl.constexpr,  # scale the weight tile before the dot (else each step's product)
    PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    x_cols = x_ptr + toks.to(tl.int64)[None, :] * stride_x
    s_row = s_ptr + (pid_n * BLOCK_N // _SCALE_BLOCK) * tl.cdiv(K, _SCALE_BLOCK)
    k_first = split * k_steps * BLOCK_K
    s_next = _step_scales(s_row, k_first, K, BLOCK_K)  # one step ahead, as in `_gemv_kernel`
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for i in tl.range(0, k_steps):
        k0 = k_first + i * BLOCK_K
        s = s_next
        s_next = _step_scales(s_row, k0 + BLOCK_K, K, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_T]
        x = tl.load(x_cols + cols[:, None], mask=col_ok[:, None] & tok_ok[None, :], other=0.0)
        if SCALE_W:
            acc = tl.dot((w.to(tl.float32) * s).to(DT), x.to(DT), acc, input_precision=PRECISION)
        else:
            acc += tl.dot(w.to(DT), x.to(DT), input_precision=PRECISION) * s
    offs = toks.to(tl.int64)[None, :] * N + rows[:, None]
    padded = tl.num_programs(1) * BLOCK_N  # workspace columns a token holds, as in `_gemv_kernel`
    slots = toks.to(tl.int64)[None, :] * padded + rows[:, None]
    store_split_tile(acc, out_ptr + offs, part_ptr + slots, row_ok[:, None] & tok_ok[None, :],
                     num_tokens.to(tl.int64) * padded, count_ptr + pid_t * tl.num_programs(1) + pid_n,
                     out_ptr.dtype.element_ty, 1.0)


def _check_config(config: Fp8LinearConfig) -> None:
    pow2 = host_math.next_power_of_2
    assert pow2(config.block_n) == config.block_n and SCALE_BLOCK % config.block_n == 0, config
    assert pow2(config.block_k) == config.block_k and pow2(config.block_t) == config.block_t, config
    if config.block_t > 1:  # tensor cores: dims of at least 16, one scale per reduction step
        assert config.block_t >= 16 and config.block_n >= 16 and 16 <= config.block_k <= SCALE_BLOCK, config


def _dot_dtype(x_dtype: torch.dtype) -> tl.dtype:
    # The interpreter computes bf16 arithmetic on raw bits, so it multiplies in float32 (same values).
    if x_dtype == torch.float32 or interpreting():
        return tl.float32
    return tl.bfloat16 if x_dtype == torch.bfloat16 else tl.float16


def plan(
    num_tokens: int, n: int, k: int, num_sms: int, config: Fp8LinearConfig | None = None
) -> tuple[Fp8LinearConfig, int]:
    """-> (launch shape, K slices) of a call with T rows: by default the shape `pick_config` gives
    next_power_of_2(T), so every T of a bucket runs one compiled variant; the slices follow T
    itself (they only size the grid, and change no compiled code)."""
    config = config or pick_config(host_math.next_power_of_2(max(num_tokens, 1)), n, num_sms)
    return config, split_count(config, num_tokens, n, k, num_sms)


# Where the dense path starts. Compared against T_b = next_power_of_2(T), as `pick_config`'s
# thresholds are: a bucket of token counts runs one path, so the warm-up's power-of-two steps
# compile every kernel that serving reaches (1024: dense from 513 tokens on).
DENSE_MIN_TOKENS = 1024


def uses_dense(num_tokens: int, dtype: torch.dtype, device_type: str) -> bool:
    """Does `fp8_linear` (config None) run T rows as dequantise-then-cuBLAS (`dense_linear`)?

    Only bf16 activations on a CUDA device with next_power_of_2(T) >= DENSE_MIN_TOKENS. fp16 stays on
    the Triton kernels: a dequantised fp16 weight loses bits for scales below 2^-15. Batch-invariant
    mode never gets here: it runs one-token steps, so its numerics never follow cuBLAS's choice of
    algorithm for a batch size.
    """
    bucket = host_math.next_power_of_2(max(num_tokens, 1))
    return device_type == "cuda" and dtype == torch.bfloat16 and bucket >= DENSE_MIN_TOKENS


def dense_linear(x2: Tensor, weight: Tensor, scale_u8: Tensor, config: Fp8DequantConfig) -> Tensor:
    """x2 [T, K] (unit stride along K) -> [T, N] x2.dtype: the weight expanded into a `torch.empty`
    scratch [N, K] of x2's dtype (one `dequant_fp8_into` launch), then one GEMM: cuBLAS on a GPU,
    accumulating in float32 (torch's default `allow_bf16_reduced_precision_reduction` lets it add
    split-K partials in bf16, an error the size of the output's own rounding); on CPU torch's own.
    weight: [N, K] float8_e4m3fn; scale_u8: [ceil(N/128), ceil(K/128)] uint8."""
    n, k = weight.shape
    dense = dequant_fp8_into(_empty(n, k, dtype=x2.dtype, device=x2.device), weight, scale_u8, config)
    return torch.mm(x2, dense.t())


def launch_constexprs(config: Fp8LinearConfig, dot_dtype: tl.dtype) -> dict[str, Any]:
    """Constexprs and launch options of the kernel `config` picks (`_gemv_kernel` when
    block_t == 1, else `_dot_kernel`): the config's, nothing of the call's sizes."""
    if config.block_t == 1:
        return dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages,
                    num_warps=config.num_warps)
    return dict(
        BLOCK_T=config.block_t, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DT=dot_dtype,
        SCALE_W=config.scale_weights and dot_dtype != tl.float16, PRECISION="ieee",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _workspace_width(config: Fp8LinearConfig, *widths: int) -> int:
    """Columns a token holds in the split-K workspace: whole `block_n` tiles of each weight."""
    return sum(host_math.cdiv(n, config.block_n) for n in widths) * config.block_n


def _launch(
    x: Tensor, weight: Tensor, scale_u8: Tensor, out: Tensor, partial: Tensor, config: Fp8LinearConfig,
    split: int, second: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """out: [T, N] x.dtype, written; partial: float32 [split, T, `_workspace_width`], the workspace
    when split > 1 (any float32 tensor otherwise); second: (weight, uint8 scales, out) of a second
    linear on the same input, in the same launch (the GEMV only)."""
    num_tokens, k = x.shape
    n = weight.shape[0]
    k_steps = host_math.cdiv(host_math.cdiv(k, config.block_k), split)
    # A single row's stride is never used; torch reports anything for it (views, expands).
    stride_x = x.stride(0) if num_tokens > 1 else k
    consts = launch_constexprs(config, _dot_dtype(x.dtype))
    if config.block_t == 1:
        w2, s2, out2 = second or (weight, scale_u8, out)
        n2 = w2.shape[0] if second else 0
        grid = (num_tokens, host_math.cdiv(n, config.block_n) + host_math.cdiv(n2, config.block_n), split)
        counters = arrival_counters(x.device, grid[0] * grid[1]) if split > 1 else partial  # else never read
        _gemv_kernel[grid](x, weight, scale_u8, out, w2, s2, out2, partial, counters, num_tokens, n, n2, k,
                           stride_x, k_steps, **consts)
        return
    assert second is None, "two weights share a launch only in the GEMV"
    grid = (host_math.cdiv(num_tokens, config.block_t), host_math.cdiv(n, config.block_n), split)
    counters = arrival_counters(x.device, grid[0] * grid[1]) if split > 1 else partial
    _dot_kernel[grid](x, weight, scale_u8, out, partial, counters, num_tokens, n, k, stride_x, k_steps,
                      **consts)


def _as_float32(y: Tensor) -> Tensor:
    """A float32 view of y's storage: the partial-sum pointer of a launch without partials
    (never written), so both launches pass the same argument types."""
    if y.dtype == torch.float32:
        return y
    flat = y.view(-1)
    return flat[: flat.numel() // 2 * 2].view(torch.float32)


def fp8_linear(
    x: Tensor, weight: Tensor, scale: Tensor, *, config: Fp8LinearConfig | Fp8DequantConfig | None = None
) -> Tensor:
    """y = x @ W^T, as `fp8_linear_reference`.

    x: [..., K] bf16 / fp16 / fp32 (rows may be strided, unit stride along K).
    weight: [N, K] float8_e4m3fn, contiguous.
    scale: [ceil(N/128), ceil(K/128)] float8_e8m0fnu or uint8 exponent bytes, contiguous.
    -> [..., N] x.dtype, float32 accumulation.
    config: None = the dense path where `uses_dense` says so, else the Triton kernels at
    `pick_config(next_power_of_2(T), N, SMs)` (T the number of rows of x); an `Fp8LinearConfig`
    forces the Triton kernels at that launch shape, an `Fp8DequantConfig` the dense path with that
    dequantisation tile (on any device, the interpreter included).
    """
    *lead, k = x.shape
    n = weight.shape[0]
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    scale_u8 = _checked_scales(weight, scale, k)
    x2 = _rows(x)
    num_tokens = x2.shape[0]
    if isinstance(config, Fp8DequantConfig) or (
        config is None and uses_dense(num_tokens, x.dtype, x.device.type)
    ):
        return dense_linear(x2, weight, scale_u8, config or DEQUANT_CONFIG).view(*lead, n)
    y = _empty(num_tokens, n, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or n == 0:
        return y.view(*lead, n)
    num_sms = multiprocessor_count(x.device)
    config, split = plan(num_tokens, n, k, num_sms, config)
    _check_config(config)
    if split == 1:
        _launch(x2, weight, scale_u8, y, _as_float32(y), config, split)
        return y.view(*lead, n)
    partial = _empty(split, num_tokens, _workspace_width(config, n), dtype=torch.float32, device=x.device)
    _launch(x2, weight, scale_u8, y, partial, config, split)
    return y.view(*lead, n)


def _checked_scales(weight: Tensor, scale: Tensor, k: int) -> Tensor:
    """The weight's exponent bytes as uint8, after checking the pair's formats and shapes."""
    n = weight.shape[0]
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k) and weight.is_contiguous()
    assert scale.dtype in (torch.float8_e8m0fnu, torch.uint8), (
        f"scales must be e8m0 or uint8, got {scale.dtype}"
    )
    assert scale.shape == (host_math.cdiv(n, SCALE_BLOCK), host_math.cdiv(k, SCALE_BLOCK))
    assert scale.is_contiguous()
    return scale.view(torch.uint8)


def _rows(x: Tensor) -> Tensor:
    """x [..., K] as [T, K] with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def fp8_linear_pair(
    x: Tensor, first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """(fp8_linear(x, *first), fp8_linear(x, *second)): two linears that read the same input, each
    (weight, scale) as `fp8_linear` takes them. A single row of x takes one GEMV launch for both
    (the K split follows the two weights' tiles together); more rows, two calls."""
    *lead, k = x.shape
    x2 = _rows(x)
    if x2.shape[0] != 1:  # one row: `pick_config` gives the GEMV
        return fp8_linear(x, *first), fp8_linear(x, *second)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    (w1, s1), (w2, s2) = first, second
    s1_u8, s2_u8 = _checked_scales(w1, s1, k), _checked_scales(w2, s2, k)
    n1, n2 = w1.shape[0], w2.shape[0]
    y1 = _empty(1, n1, dtype=x.dtype, device=x.device)
    y2 = _empty(1, n2, dtype=x.dtype, device=x.device)
    config, split = plan(1, _workspace_width(GEMV_CONFIG, n1, n2), k, multiprocessor_count(x.device))
    partial = (_empty(split, 1, _workspace_width(config, n1, n2), dtype=torch.float32, device=x.device)
               if split > 1 else _as_float32(y1))
    _launch(x2, w1, s1_u8, y1, partial, config, split, second=(w2, s2_u8, y2))
    return y1.view(*lead, n1), y2.view(*lead, n2)
