"""mHC pre / post mixing kernels (see `reference.py` for the math).

`mhc_pre` is two launches:

1. `_mix_partial_kernel`, a split-K GEMM: `x [T, n*D] @ fn^T [n*D, (2+n)n]` plus the per-token sum of
   squares for the RMS norm (applied afterwards: rms(x) is a scalar per token, so
   `(x / rms) @ fn^T = (x @ fn^T) / rms`). Program (t, s) owns `BLOCK_T` tokens and the s-th slice
   of the n*D reduction; it writes float32 partials `[SPLIT_K, T, NMIX_PAD]`. At decode the read of
   the float32 mixing weight (24 x 16384 x 4 B = 1.57 MB) dominates everything else, and a plain
   GEMV would put it through a handful of SMs; splitting K spreads it over the whole chip.
2. `_pre_finish_kernel`: program (t, c) sums token t's partials, applies the norm, the sigmoids,
   the row softmax and the Sinkhorn iterations on the n x n matrix (all in registers; tiny), and
   writes the collapsed stream `sum_i pre_i X_i` for its slice c of the D channels. The finish is
   recomputed by each of a token's channel slices (a few hundred flops) instead of being passed
   between launches; slice 0 writes `post` and `comb`.

`mhc_head` (the final collapse before the output norm: no post, comb or Sinkhorn) is the same mixing
GEMM over its n mixes (padded to the dot's 16 columns) and `_head_finish_kernel`, a finish without
the Sinkhorn: two launches where the torch chain takes about fourteen once a step.

`mhc_post` is one launch: program (t, c) reads the n streams' channel slice c once, forms
`post_k * y + sum_j comb[j, k] X_j` for all k in registers and writes the n output streams.

Every dot keeps float32 accuracy (the mixes feed sigmoids and a softmax whose inputs the model
computes in float32): plain float32 FMA (`input_precision="ieee"`) for decode-sized batches, 3xTF32 on
the tensor cores from `TF32X3_MIN_TOKENS` tokens (`mix_precision`): float32 FMA made the mixing GEMM
of a prefill step many times its bytes' time (TUNING.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from antumbra.kernels.common import host_math
from antumbra.kernels.common.device import multiprocessor_count
from antumbra.kernels.common.interpreter import interpreting, prepare

prepare()


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocation of float outputs and workspaces; tests swap in a NaN fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


# Token counts, split counts and trip counts follow the step's size: not specialised (masks and
# loop bounds), so a variant depends only on the model's widths and the bucketed tiles. K and D,
# model widths and row strides, keep their divisibility hints.
@triton.jit(do_not_specialize=["num_tokens", "k_iters"])
def _mix_partial_kernel(
    x_ptr,  # *T [T, K] streams flattened to n*D channels, contiguous
    fn_ptr,  # *f32 [NMIX, K] mixing weight, contiguous
    part_ptr,  # *f32 [SPLIT_K, T, NMIX_PAD] out: partial x @ fn^T of each K slice
    sq_ptr,  # *f32 [SPLIT_K, T] out: partial sum of x^2 of each K slice
    num_tokens,
    K,
    k_iters,  # BLOCK_K steps per K slice
    NMIX: tl.constexpr,
    NMIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    mixes = tl.arange(0, NMIX_PAD)
    mix_ok = mixes < NMIX
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_T, NMIX_PAD], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for it in tl.range(0, k_iters):
        ks = (pid_k * k_iters + it) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K  # slices are disjoint: only the last one runs past K
        x = tl.load(x_rows + ks[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + mixes[:, None] * K + ks[None, :], mask=mix_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    out_rows = pid_k * num_tokens + toks
    tl.store(part_ptr + out_rows[:, None] * NMIX_PAD + mixes[None, :], acc, mask=tok_ok[:, None])
    tl.store(sq_ptr + out_rows, sq, mask=tok_ok)


@triton.jit
def _summed_mixes(rows, s_ok, first, i, i_ok):
    """Mixes first + i (i < N) summed over the K slices' partial rows [SPLIT_PAD] -> [NP] float32."""
    return tl.sum(tl.load(rows[:, None] + first + i[None, :], mask=s_ok[:, None] & i_ok[None, :], other=0.0),
                  axis=0)


@triton.jit
def _inv_rms(sq_ptr, s, s_ok, num_tokens, t, norm_eps, width):
    """1 / rms of token t's flattened streams from the K slices' partial sums of squares."""
    sq = tl.sum(tl.load(sq_ptr + s * num_tokens + t, mask=s_ok, other=0.0), axis=0)
    return tl.rsqrt(sq / width + norm_eps)


@triton.jit
def _collapse(x_ptr, collapsed_ptr, pre, t, pid_d, d_iters, i, i_ok, D, N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """collapsed[t] = sum_i pre_i X_i over this program's channel slice (d_iters steps of BLOCK_D)."""
    t64 = t.to(tl.int64)
    for it in tl.range(0, d_iters):
        ch = (pid_d * d_iters + it) * BLOCK_D + tl.arange(0, BLOCK_D)
        ch_ok = ch < D  # slices are disjoint: only the last one runs past D
        xs = tl.load(x_ptr + (t64 * N + i[:, None]) * D + ch[None, :], mask=i_ok[:, None] & ch_ok[None, :],
                     other=0.0).to(tl.float32)
        out = tl.sum(pre[:, None] * xs, axis=0)
        tl.store(collapsed_ptr + t64 * D + ch, out.to(collapsed_ptr.dtype.element_ty), mask=ch_ok)


@triton.jit(do_not_specialize=["num_tokens", "split_k", "d_iters"])
def _pre_finish_kernel(
    x_ptr,  # *T [T, N, D] streams, contiguous
    part_ptr,  # *f32 [SPLIT_K, T, NMIX_PAD] partial mixes from _mix_partial_kernel
    sq_ptr,  # *f32 [SPLIT_K, T] partial sums of squares
    base_ptr,  # *f32 [NMIX] biases (pre | post | comb)
    scale_ptr,  # *f32 [3] scales (pre, post, comb)
    collapsed_ptr,  # *T [T, D] out: sum_i pre_i X_i
    post_ptr,  # *f32 [T, N] out
    comb_ptr,  # *f32 [T, N, N] out
    num_tokens,
    D,
    split_k,
    d_iters,  # BLOCK_D steps per program's channel slice
    hc_eps,
    norm_eps,
    ITERS: tl.constexpr,  # Sinkhorn iterations
    N: tl.constexpr,
    NP: tl.constexpr,
    NMIX_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # a power of two >= split_k
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < split_k
    i = tl.arange(0, NP)
    i_ok = i < N
    ok2 = i_ok[:, None] & i_ok[None, :]

    # Reduce the K slices: [SPLIT_PAD, NP] (pre, post) and [SPLIT_PAD, NP, NP] (comb) tiles.
    rows = part_ptr + (s * num_tokens + t).to(tl.int64) * NMIX_PAD
    pre_l = _summed_mixes(rows, s_ok, 0, i, i_ok)
    post_l = _summed_mixes(rows, s_ok, N, i, i_ok)
    comb_offs = 2 * N + i[:, None] * N + i[None, :]
    m3 = s_ok[:, None, None] & ok2[None, :, :]
    comb_l = tl.sum(tl.load(rows[:, None, None] + comb_offs[None, :, :], mask=m3, other=0.0), axis=0)
    inv_rms = _inv_rms(sq_ptr, s, s_ok, num_tokens, t, norm_eps, N * D)

    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_l * inv_rms * s_pre + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + hc_eps
    post = 2.0 * tl.sigmoid(post_l * inv_rms * s_post + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))
    logits = comb_l * inv_rms * s_comb + tl.load(base_ptr + comb_offs, mask=ok2, other=0.0)
    # Padding (N < NP) must not join any sum: a large finite negative logit (not -inf, which would
    # give NaN on all-padding rows), then zeros after the softmax.
    logits = tl.where(ok2, logits, -1.0e30)
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(ok2, p / tl.sum(p, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.range(0, ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    if pid_d == 0:
        tl.store(post_ptr + t * N + i, post, mask=i_ok)
        tl.store(comb_ptr + t * N * N + i[:, None] * N + i[None, :], comb, mask=ok2)
    _collapse(x_ptr, collapsed_ptr, pre, t, pid_d, d_iters, i, i_ok, D, N, BLOCK_D)


@triton.jit
def _post_kernel(
    x_ptr,  # *T [T, N, D] streams, contiguous
    y_ptr,  # *T2 [T, D] sub-block output, contiguous
    post_ptr,  # *f32 [T, N]
    comb_ptr,  # *f32 [T, N, N]
    out_ptr,  # *T [T, N, D] out: new streams
    D,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_ok = ch < D
    k = tl.arange(0, NP)
    k_ok = k < N
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0)
    y = tl.load(y_ptr + t * D + ch, mask=ch_ok, other=0.0).to(tl.float32)
    acc = post[:, None] * y[None, :]  # [NP, BLOCK_D]: row k is output stream k
    for j in tl.static_range(N):
        xj = tl.load(x_ptr + (t * N + j) * D + ch, mask=ch_ok, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * N * N + j * N + k, mask=k_ok, other=0.0)  # comb[j, :]
        acc += cj[:, None] * xj[None, :]
    out_offs = (t * N + k[:, None]) * D + ch[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & ch_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "split_k", "d_iters"])
def _head_finish_kernel(
    x_ptr,  # *T [T, N, D] streams, contiguous
    part_ptr,  # *f32 [SPLIT_K, T, NMIX_PAD] partial mixes from _mix_partial_kernel (the first N used)
    sq_ptr,  # *f32 [SPLIT_K, T] partial sums of squares
    base_ptr,  # *f32 [N] biases
    scale_ptr,  # *f32 [1] scale
    collapsed_ptr,  # *T [T, D] out: sum_i pre_i X_i
    num_tokens,
    D,
    split_k,
    d_iters,  # BLOCK_D steps per program's channel slice
    hc_eps,
    norm_eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    NMIX_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # a power of two >= split_k
    BLOCK_D: tl.constexpr,
):
    """The final collapse (`mhc_head`): as `_pre_finish_kernel` without post, comb and Sinkhorn."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    s_ok = s < split_k
    i = tl.arange(0, NP)
    i_ok = i < N
    mix = _summed_mixes(part_ptr + (s * num_tokens + t).to(tl.int64) * NMIX_PAD, s_ok, 0, i, i_ok)
    inv_rms = _inv_rms(sq_ptr, s, s_ok, num_tokens, t, norm_eps, N * D)
    base = tl.load(base_ptr + i, mask=i_ok, other=0.0)
    pre = tl.sigmoid(mix * inv_rms * tl.load(scale_ptr) + base) + hc_eps
    _collapse(x_ptr, collapsed_ptr, pre, t, pid_d, d_iters, i, i_ok, D, N, BLOCK_D)


def mix_block_k(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 32


@dataclass(frozen=True)
class PreTiles:
    """Launch shape overrides of `mhc_pre` (None / defaults: the planned shape). Every choice gives the
    same values up to float32 summation order; `benchmarks/kernels/mhc.py` times them at prefill sizes,
    where the two launches are furthest from their bytes' time (TUNING.md)."""

    mix_block_t: int | None = None  # tokens per mixing-GEMM program (None: 16 / 32 / 64 by T)
    mix_warps: int = 4
    # The finish's Sinkhorn reductions cross warps through shared memory. None: `finish_warps(T)`.
    finish_warps: int | None = None


DEFAULT_PRE_TILES = PreTiles()
# From next_power_of_2(T) = 1024 up, and at decode sizes (up to DECODE_TOKENS), the finish runs one
# warp a program: its Sinkhorn reductions then need no shared-memory crossing between warps, which the
# sweeps found faster than two or four warps at both ends (TUNING.md). Sizes in between keep four.
ONE_WARP_FINISH_TOKENS = 1024
DECODE_TOKENS = 32


def finish_warps(num_tokens: int) -> int:
    """Warps of a finish program for T tokens (a function of next_power_of_2(T))."""
    bucket = host_math.next_power_of_2(max(num_tokens, 1))
    return 1 if bucket >= ONE_WARP_FINISH_TOKENS or bucket <= DECODE_TOKENS else 4


def mix_plan(
    num_tokens: int, k: int, block_k: int, num_sms: int, split_k: int | None = None,
    block_t: int | None = None,
) -> tuple[int, int, int]:
    """-> (BLOCK_T, K slices, BLOCK_K steps per slice) of the mixing GEMM for T tokens: token tiles
    of 16 / 32 / 64 (a function of next_power_of_2(T)) unless `block_t` is given, and by default
    enough K slices for about one program per SM at decode sizes (next_power_of_2(T) up to
    DECODE_TOKENS), two above: at decode sizes two slices per SM measured slower (TUNING.md)."""
    if block_t is None:
        block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 64 else 64
    t_blocks = host_math.cdiv(num_tokens, block_t)
    k_blocks = host_math.cdiv(k, block_k)
    if split_k is None:
        decode = host_math.next_power_of_2(max(num_tokens, 1)) <= DECODE_TOKENS
        split_k = host_math.cdiv((1 if decode else 2) * num_sms, t_blocks)
    split_k = max(1, min(split_k, k_blocks))
    k_iters = host_math.cdiv(k_blocks, split_k)
    return block_t, host_math.cdiv(k_blocks, k_iters), k_iters


def split_pad(num_tokens: int, k: int, block_k: int, num_sms: int) -> int:
    """SPLIT_PAD of the finish kernel: a power of two at least the K slices any T of
    next_power_of_2(num_tokens)'s bucket plans (the slices only shrink as T grows, so the
    bucket's smallest T bounds them). Padded slices load as zeros."""
    bucket = host_math.next_power_of_2(max(num_tokens, 1))
    lowest = bucket // 2 + 1 if bucket > 1 else 1
    return host_math.next_power_of_2(mix_plan(lowest, k, block_k, num_sms)[1])


TF32X3_MIN_TOKENS = 64


def mix_precision(num_tokens: int) -> str:
    """The mixing GEMM's float32 dot mode for T tokens (the interpreter: always "ieee")."""
    return "tf32x3" if num_tokens >= TF32X3_MIN_TOKENS and not interpreting() else "ieee"


def pre_constexprs(
    num_tokens: int, n: int, d: int, iters: int, block_k: int, num_sms: int, precision: str | None = None,
    split_k: int | None = None, tiles: PreTiles = DEFAULT_PRE_TILES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> constexprs and launch options of (the mixing GEMM, the finish kernel) for T tokens of n
    streams of d channels: functions of next_power_of_2(T) and the model's widths only (precision:
    None = `mix_precision(T)`, a function of T >= 64)."""
    nmix = (2 + n) * n
    mix, finish = _mix_and_finish(num_tokens, n, d, nmix, host_math.next_power_of_2(nmix), block_k, num_sms,
                                  precision, split_k, tiles)
    return mix, dict(finish, ITERS=int(iters))


def _mix_and_finish(
    num_tokens: int, n: int, d: int, nmix: int, nmix_pad: int, block_k: int, num_sms: int,
    precision: str | None = None, split_k: int | None = None, tiles: PreTiles = DEFAULT_PRE_TILES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mixing GEMM's constexprs for `nmix` mixes (padded to `nmix_pad` columns), and those its
    finish shares (`_pre_finish_kernel`, `_head_finish_kernel`)."""
    block_t, splits, _ = mix_plan(num_tokens, n * d, block_k, num_sms, split_k, tiles.mix_block_t)
    mix = dict(
        NMIX=nmix, NMIX_PAD=nmix_pad, BLOCK_T=block_t, BLOCK_K=block_k,
        PRECISION=precision or mix_precision(num_tokens), num_warps=tiles.mix_warps,
    )
    pad = max(split_pad(num_tokens, n * d, block_k, num_sms), host_math.next_power_of_2(splits))
    finish = dict(
        N=n, NP=host_math.next_power_of_2(n), NMIX_PAD=nmix_pad, SPLIT_PAD=pad,
        BLOCK_D=min(512, host_math.next_power_of_2(d)),
        num_warps=finish_warps(num_tokens) if tiles.finish_warps is None else tiles.finish_warps,
    )
    return mix, finish


def _mix_partials(
    streams: Tensor, fn: Tensor, mix: dict[str, Any], num_sms: int, block_k: int, split_k: int | None,
    tiles: PreTiles,
) -> tuple[Tensor, Tensor]:
    """The mixing GEMM's launch -> (partial mixes [splits, T, NMIX_PAD], partial sums of squares
    [splits, T]), float32."""
    num_tokens, n, d = streams.shape
    block_t, splits, k_iters = mix_plan(num_tokens, n * d, block_k, num_sms, split_k, tiles.mix_block_t)
    part = _empty(splits, num_tokens, mix["NMIX_PAD"], dtype=torch.float32, device=streams.device)
    sq = _empty(splits, num_tokens, dtype=torch.float32, device=streams.device)
    _mix_partial_kernel[(host_math.cdiv(num_tokens, block_t), splits)](
        streams, fn, part, sq, num_tokens, n * d, k_iters, **mix
    )
    return part, sq


def _finish_grid(num_tokens: int, d: int, block_d: int, num_sms: int) -> tuple[int, int]:
    """-> (channel slices a token, BLOCK_D steps a slice) of a finish: about one program per SM."""
    d_blocks = host_math.cdiv(d, block_d)
    d_split = max(1, min(d_blocks, host_math.cdiv(num_sms, num_tokens)))
    d_iters = host_math.cdiv(d_blocks, d_split)
    return host_math.cdiv(d_blocks, d_iters), d_iters


def post_constexprs(
    num_tokens: int, n: int, d: int, num_sms: int, block_d: int | None = None
) -> dict[str, Any]:
    """Constexprs and launch options of `_post_kernel`: programs of 256..1024 channels, at least
    ~one per SM when next_power_of_2(T) is small (each output is one fused multiply-add chain, so
    the tile does not change any value)."""
    if block_d is None:
        bucket = host_math.next_power_of_2(max(num_tokens, 1))
        block_d = 1024
        while block_d > 256 and bucket * host_math.cdiv(d, block_d) < num_sms:
            block_d //= 2
    block_d = min(block_d, host_math.next_power_of_2(d))
    return dict(N=n, NP=host_math.next_power_of_2(n), BLOCK_D=block_d,
                num_warps=max(1, min(4, block_d // 256)))


def mhc_pre(
    streams: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    split_k: int | None = None,
    precision: str | None = None,
    tiles: PreTiles = DEFAULT_PRE_TILES,
) -> tuple[Tensor, Tensor, Tensor]:
    """streams: [T, n, D] float (contiguous); fn: [(2+n)n, n*D] float32; base: [(2+n)n] float32; scale: [3].

    -> (collapsed [T, D] streams.dtype, post [T, n] float32, comb [T, n, n] float32), as
    `mhc_pre_reference`. split_k: K slices of the GEMM (None = enough programs for ~2 per SM);
    precision: the float32 dot mode ("ieee" or "tf32x3"; "tf32" loses about 3 decimal digits; None =
    `mix_precision(T)`); tiles: launch shape overrides (`PreTiles`).
    """
    num_tokens, n, d = streams.shape
    k = n * d
    nmix = (2 + n) * n
    assert streams.is_contiguous() and streams.is_floating_point()
    assert fn.shape == (nmix, k) and fn.dtype == torch.float32 and fn.is_contiguous()
    assert base.shape == (nmix,) and base.dtype == torch.float32
    assert scale.shape == (3,) and scale.dtype == torch.float32
    assert iters >= 1
    device = streams.device
    collapsed = _empty(num_tokens, d, dtype=streams.dtype, device=device)
    post = _empty(num_tokens, n, dtype=torch.float32, device=device)
    comb = _empty(num_tokens, n, n, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return collapsed, post, comb

    sms = multiprocessor_count(device)
    block_k = mix_block_k(device)
    mix, finish = pre_constexprs(num_tokens, n, d, iters, block_k, sms, precision, split_k, tiles)
    part, sq = _mix_partials(streams, fn, mix, sms, block_k, split_k, tiles)
    d_split, d_iters = _finish_grid(num_tokens, d, finish["BLOCK_D"], sms)
    _pre_finish_kernel[(num_tokens, d_split)](
        streams, part, sq, base.contiguous(), scale.contiguous(), collapsed, post, comb,
        num_tokens, d, part.shape[0], d_iters, float(hc_eps), float(norm_eps), **finish,
    )
    return collapsed, post, comb


def mhc_post(
    streams: Tensor, block_out: Tensor, post: Tensor, comb: Tensor, *, block_d: int | None = None
) -> Tensor:
    """streams: [T, n, D]; block_out: [T, D]; post: [T, n] float32; comb: [T, n, n] float32.

    -> new streams [T, n, D] streams.dtype, as `mhc_post_reference`. All contiguous, one device.
    """
    num_tokens, n, d = streams.shape
    assert streams.is_contiguous() and block_out.is_contiguous() and block_out.shape == (num_tokens, d)
    assert post.shape == (num_tokens, n) and post.dtype == torch.float32 and post.is_contiguous()
    assert comb.shape == (num_tokens, n, n) and comb.dtype == torch.float32 and comb.is_contiguous()
    out = _empty(num_tokens, n, d, dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return out
    consts = post_constexprs(num_tokens, n, d, multiprocessor_count(streams.device), block_d)
    _post_kernel[(num_tokens, host_math.cdiv(d, consts["BLOCK_D"]))](
        streams, block_out, post, comb, out, d, **consts
    )
    return out


# The dot of the mixing GEMM needs at least 16 output columns; the head's n mixes are padded to it.
HEAD_MIX_PAD = 16


def head_constexprs(
    num_tokens: int, n: int, d: int, block_k: int, num_sms: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """-> constexprs and launch options of (the mixing GEMM, the head's finish) for T tokens of n
    streams of d channels, planned as `pre_constexprs` plans them."""
    return _mix_and_finish(num_tokens, n, d, n, max(HEAD_MIX_PAD, host_math.next_power_of_2(n)), block_k,
                           num_sms)


def mhc_head(
    streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, hc_eps: float, norm_eps: float
) -> Tensor:
    """The final collapse of the streams before the output norm, as `mhc_head_reference`: streams
    [T, n, D] float (contiguous); fn [n, n*D] float32; base [n] float32; scale [1] float32 ->
    [T, D] streams.dtype. Two launches: the mixing GEMM of `mhc_pre`, then the collapse."""
    num_tokens, n, d = streams.shape
    assert streams.is_contiguous() and streams.is_floating_point()
    assert fn.shape == (n, n * d) and fn.dtype == torch.float32 and fn.is_contiguous()
    assert base.shape == (n,) and base.dtype == torch.float32
    assert scale.shape == (1,) and scale.dtype == torch.float32
    device = streams.device
    collapsed = _empty(num_tokens, d, dtype=streams.dtype, device=device)
    if num_tokens == 0:
        return collapsed
    sms = multiprocessor_count(device)
    block_k = mix_block_k(device)
    mix, finish = head_constexprs(num_tokens, n, d, block_k, sms)
    part, sq = _mix_partials(streams, fn, mix, sms, block_k, None, DEFAULT_PRE_TILES)
    d_split, d_iters = _finish_grid(num_tokens, d, finish["BLOCK_D"], sms)
    _head_finish_kernel[(num_tokens, d_split)](
        streams, part, sq, base.contiguous(), scale.contiguous(), collapsed, num_tokens, d, part.shape[0],
        d_iters, float(hc_eps), float(norm_eps), **finish,
    )
    return collapsed
