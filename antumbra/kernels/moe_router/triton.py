"""The MoE router after its gate projection in one launch (see `reference.py`).

Program t owns token t's row of E gate logits, all in registers: the scores, the choice (k rounds of
argmax over the biased scores, each clearing its winner; or the token's `tid2eid` row), routing
replay, the gather of the chosen scores and their normalisation. The torch chain it replaces is
about nine launches a layer (two for the scores, the bias and top-k, the gather, the sum, the
epsilon, the quotient and the scaling), each at decode sizes costing more than its work.

Values follow the torch chain op by op: softplus is `x > 20 ? x : log1p(exp(x))` and the sigmoid
`1 / (1 + exp(-x))` in float32 with, compiled, the CUDA math library's `exp` / `log1p` (the ones
torch's CUDA kernels call); each op's result is rounded to the logits' dtype where torch rounds it.
Two things are not bitwise the chain's: the sum of a row's k weights adds in the reduction's order
(float32 either way, then rounded), and ties in the biased scores go to the lowest expert id. The
CPU interpreter evaluates `exp` / `log1p` with NumPy, within an ulp of torch's CPU values.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from antumbra.kernels.common import host_math
from antumbra.kernels.common.codecs import narrowed, rounded_to, widened
from antumbra.kernels.common.interpreter import interpreting, prepare

from .reference import NORM_EPS, SCORINGS

prepare()

# The interpreter has no libdevice; a module constant rather than a constexpr argument, since it
# is fixed per process and so belongs in no launch key.
_LIBDEVICE = tl.constexpr(not interpreting())
DTYPES = (torch.bfloat16, torch.float32)  # gate logits the kernel takes
_SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's default: above it softplus(x) is x
_NORM_EPS = tl.constexpr(NORM_EPS)


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation; tests swap in a poisoned fill to catch unwritten elements."""
    return torch.empty(*shape, dtype=dtype, device=device)


@triton.jit
def _exp(x):
    if _LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _scores(x, SQRT_SOFTPLUS: tl.constexpr, DT: tl.constexpr):
    """float32 gate logits -> float32 scores rounded to DT as torch rounds each op."""
    if SQRT_SOFTPLUS:
        if _LIBDEVICE:
            soft = libdevice.log1p(libdevice.exp(x))
        else:  # log1p(e) = log(u) * e / (u - 1), u = 1 + e: accurate where u rounds to 1
            e = tl.exp(x)
            u = 1.0 + e
            soft = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        soft = rounded_to(tl.where(x > _SOFTPLUS_THRESHOLD, x, soft), DT)
        return rounded_to(tl.sqrt_rn(soft), DT)
    return rounded_to(tl.math.div_rn(1.0, 1.0 + _exp(-x)), DT)


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] contiguous, bfloat16 / float32
    bias_ptr,  # [E] float32 correction bias (score routing)
    token_ids_ptr,  # [T] int64 (hash routing)
    tid2eid_ptr,  # [V, K] int32 / int64 contiguous (hash routing)
    replay_ptr,  # [T, K] int64 contiguous, -1 = the router's choice (REPLAY)
    weights_ptr,  # [T, K] out, the logits' dtype or float32
    ids_ptr,  # [T, K] out, int64
    scaling,  # float32 routed scaling factor
    E: tl.constexpr,  # experts (the model's width)
    E_PAD: tl.constexpr,
    K: tl.constexpr,  # experts a token
    K_PAD: tl.constexpr,
    SQRT_SOFTPLUS: tl.constexpr,  # else sigmoid
    HASH: tl.constexpr,
    REPLAY: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dt = logits_ptr.dtype.element_ty  # values round to it; they are stored in the weights' dtype
    experts = tl.arange(0, E_PAD)
    expert_ok = experts < E
    logits = widened(tl.load(logits_ptr + t * E + experts, mask=expert_ok, other=0.0))
    scores = tl.where(expert_ok, _scores(logits, SQRT_SOFTPLUS, dt), 0.0)
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < K
    if HASH:
        token = tl.load(token_ids_ptr + t)
        ids = tl.load(tid2eid_ptr + token * K + slots, mask=slot_ok, other=0).to(tl.int64)
    else:
        biased = scores + tl.load(bias_ptr + experts, mask=expert_ok, other=0.0)
        biased = tl.where(expert_ok, biased, -float("inf"))
        ids = tl.zeros([K_PAD], tl.int64)
        for j in tl.static_range(K):
            best = tl.argmax(biased, 0, tie_break_left=True)
            ids = tl.where(slots == j, best.to(tl.int64), ids)
            biased = tl.where(experts == best, -float("inf"), biased)
    if REPLAY:
        replayed = tl.load(replay_ptr + t * K + slots, mask=slot_ok, other=-1)
        ids = tl.where(replayed >= 0, replayed, ids)
    picked = tl.sum(tl.where(experts[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    picked = tl.where(slot_ok, picked, 0.0)
    denom = rounded_to(rounded_to(tl.sum(picked, axis=0), dt) + _NORM_EPS, dt)
    weights = rounded_to(rounded_to(tl.math.div_rn(picked, denom), dt) * scaling, dt)
    tl.store(weights_ptr + t * K + slots, narrowed(weights, weights_ptr.dtype.element_ty), mask=slot_ok)
    tl.store(ids_ptr + t * K + slots, ids, mask=slot_ok)


def route_constexprs(
    num_experts: int, top_k: int, scoring: str, hashed: bool, replay: bool
) -> dict[str, Any]:
    """Constexprs and launch options: the model's widths and the layer's kind, never the token count."""
    e_pad = host_math.next_power_of_2(num_experts)
    return dict(E=num_experts, E_PAD=e_pad, K=top_k, K_PAD=host_math.next_power_of_2(top_k),
                SQRT_SOFTPLUS=scoring == "sqrtsoftplus", HASH=hashed, REPLAY=replay,
                num_warps=max(1, min(8, e_pad // 128)))


def route(
    logits: Tensor, top_k: int, scaling: float, scoring: str, *, bias: Tensor | None = None,
    token_ids: Tensor | None = None, tid2eid: Tensor | None = None, replay: Tensor | None = None,
    weights_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """As `route_reference`: logits [T, E] bfloat16 / float32; score routing with `bias` [E] float32,
    or hash routing with `token_ids` [T] and `tid2eid` [V, k] int32 / int64; replay [T, k] int64 or None ->
    (weights [T, k], ids [T, k] int64), every tensor on one device. The weights' values are the
    reference's (rounded to the logits' dtype); `weights_dtype` float32 holds them in float32 (what the
    MXFP4 experts read: it saves their cast), None in the logits' dtype."""
    assert scoring in SCORINGS, f"scoring must be one of {SCORINGS}, got {scoring!r}"
    assert logits.dim() == 2 and logits.dtype in DTYPES, (
        f"logits must be [T, E] bfloat16 or float32, got {tuple(logits.shape)} {logits.dtype}")
    rows, num_experts = logits.shape
    assert 0 < top_k <= num_experts, f"top_k must be in 1..{num_experts}, got {top_k}"
    hashed = tid2eid is not None
    device = logits.device
    if tid2eid is not None:
        assert token_ids is not None and token_ids.shape == (rows,), "hash routing needs token_ids [T]"
        assert tid2eid.dim() == 2 and tid2eid.shape[1] == top_k, f"tid2eid must be [V, {top_k}]"
        assert tid2eid.dtype in (torch.int32, torch.int64), f"tid2eid must be integers, got {tid2eid.dtype}"
    else:
        assert bias is not None and bias.shape == (num_experts,) and bias.dtype == torch.float32, (
            "score routing needs a float32 bias [E]")
    if replay is not None:
        assert replay.shape == (rows, top_k), f"replay must be [{rows}, {top_k}], got {tuple(replay.shape)}"
    assert weights_dtype in (None, torch.float32, logits.dtype), f"weights_dtype {weights_dtype} would round"
    weights = _empty(rows, top_k, dtype=weights_dtype or logits.dtype, device=device)
    ids = _empty(rows, top_k, dtype=torch.int64, device=device)
    if rows:
        unused = ids  # any tensor of the device: a pointer the kernel's constexprs never read
        consts = route_constexprs(num_experts, top_k, scoring, hashed, replay is not None)
        _route_kernel[(rows,)](
            logits.contiguous(), unused if bias is None else bias.contiguous(),
            unused if token_ids is None else token_ids.contiguous(),
            unused if tid2eid is None else tid2eid.contiguous(),
            unused if replay is None else replay.long().contiguous(),
            weights, ids, float(scaling), **consts,
        )
    return weights, ids
