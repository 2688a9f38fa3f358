"""Drafting and verifying speculative tokens so that the output follows the target's distribution.

Rows are requests; each drafted k tokens d_1..d_k from the draft's distributions q_1..q_k, and the
target's verify step gave p_0..p_k (p_j: the target's distribution for the token after d_1..d_j).
Both are the distributions the request's sampling settings make of the logits (temperature, then the
top-k / top-p / min_p cut, `sampling_cuts`), applied alike to target and draft:

* greedy rows (temperature 0): accept d_j while d_j == argmax p_{j-1}; the first mismatch emits
  argmax p_{j-1}; when all k are accepted the bonus token is argmax p_k;
* sampling rows: accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection
  emit a draw from norm(max(0, p_{j-1} - q_j)); when all are accepted, a draw from p_k. Each emitted
  token then follows the target's distribution exactly (the standard speculative-sampling rule).

Randomness is not drawn from a generator: it is the sampling race's counter-based noise
(`kernels/sampling/reference.py`), a pure function of the request's seed, a counter and a column.
The decision about output token c (the request's c-th sampled token, counting from 0) reads
counter c: its acceptance uniform is column V of that noise row, the residual or bonus draw is the
Gumbel race over columns 0..V-1. Drafting uses the same counters under the seed xor `DRAFT_SALT`, so
draft choices are independent of the acceptance test. A row's tokens depend on its seed, its
progress and its logits only; everything runs on the logits' device, one batch at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from antumbra.kernels.sampling import pack_rows
from antumbra.kernels.sampling.reference import UNIFORM_BITS, noise_bits_reference

from ..sampling_cuts import min_p_slack, temperature, top_k_top_p_floor
from ..sampling_params import SamplingParams

DRAFT_SALT = 0x5EED_D4AF_7000_0001  # xor-ed into a request's seed for its draft draws
_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Verdict:
    tokens: Tensor  # [B, k + 1] int64: the accepted drafts, then the correction or bonus token, -1 after
    num_accepted: Tensor  # [B] int64 drafts accepted; the row emits num_accepted + 1 tokens


def sampling_probs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """logits [N, V] -> [N, V] float32 the distribution row i samples from under params[i]: softmax of
    logits / T over the tokens the top-k / top-p / min_p cut keeps; one-hot on the argmax (the lowest
    id among ties) for greedy rows."""
    raw = logits.float()
    floor = top_k_top_p_floor(raw, params)
    if floor is None:
        floor = torch.full((raw.shape[0],), float("-inf"), device=raw.device)
    slack = min_p_slack(params).to(raw.device)
    floor = torch.maximum(floor, torch.where(slack == float("-inf"), slack, raw.amax(dim=-1) + slack))
    kept = raw.masked_fill(raw < floor[:, None], float("-inf"))
    temps = _temperatures(params, raw.device)
    greedy = temps == 0
    probs = torch.softmax(kept / torch.where(greedy, torch.ones_like(temps), temps)[:, None], dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(1, raw.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def _temperatures(params: Sequence[SamplingParams], device: torch.device) -> Tensor:
    return torch.tensor([temperature(p) for p in params], dtype=torch.float32).to(device)


def _uniforms(seeds: Sequence[int], counters: Sequence[int], columns: int, device: torch.device) -> Tensor:
    """[N, columns] float32 uniforms in (0, 1): the race's noise rows of (seed, counter)."""
    rows = pack_rows([s & _SEED_MASK for s in seeds], list(counters), [1.0] * len(seeds)).to(device)
    bits = (noise_bits_reference(rows, columns) >> (32 - UNIFORM_BITS)).clamp_min(1)
    return bits.to(torch.float32) * 2.0**-UNIFORM_BITS


def _race(probs: Tensor, uniforms: Tensor, greedy: Tensor) -> Tensor:
    """One draw per row from probs [N, V] with the Gumbel race on uniforms [N, V]; greedy rows
    [N] bool take the argmax."""
    gumbel = -torch.log(-torch.log(uniforms))
    score = torch.log(probs) + torch.where(greedy[:, None], torch.zeros_like(gumbel), gumbel)
    return score.argmax(dim=-1)


def sample_draft(
    logits: Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """One draft token per row. logits [B, V] (the draft's), counters [B]: the output index the
    drafted token would take -> (tokens [B] int64, q [B, V] float32 the distribution it came from)."""
    if all(temperature(p) == 0 for p in params):  # the race's outcome on greedy rows: no noise needed
        tokens = logits.argmax(dim=-1)
        return tokens, torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
            1, tokens[:, None], 1.0)
    q = sampling_probs(logits, params)
    salted = [(s ^ DRAFT_SALT) & _SEED_MASK for s in seeds]
    u = _uniforms(salted, counters, q.shape[1], q.device)
    return _race(q, u, _temperatures(params, q.device) == 0), q


def verify(
    target_logits: Tensor,
    draft_probs: Tensor,
    drafts: Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    counters: Sequence[int],
) -> Verdict:
    """target_logits [B, k + 1, V] (row j: after the context and d_1..d_j), draft_probs [B, k, V] (q_j,
    as `sample_draft` returned them), drafts [B, k] int64, counters [B]: the output index of d_1."""
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    device = target_logits.device
    if all(temperature(p) == 0 for p in params):
        return _verify_greedy(target_logits, drafts)
    row_params = [p for p in params for _ in range(k1)]
    p = sampling_probs(target_logits.reshape(b * k1, vocab), row_params).view(b, k1, vocab)
    steps = [c + j for c in counters for j in range(k1)]
    u = _uniforms([s for s in seeds for _ in range(k1)], steps, vocab + 1, device).view(b, k1, vocab + 1)
    greedy = _temperatures(params, device) == 0  # [B]
    if k:
        p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, k]
        q_d = draft_probs.float().gather(2, drafts[..., None]).squeeze(-1)
        accepted = u[:, :k, vocab] * q_d < p_d
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
    else:
        num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    at = num_accepted[:, None, None]
    p_at = p.gather(1, at.expand(-1, 1, vocab)).squeeze(1)  # [B, V]
    final_dist = p_at
    if k:
        q_at = draft_probs.float().gather(1, at.clamp(max=k - 1).expand(-1, 1, vocab)).squeeze(1)
        residual = (p_at - q_at).clamp_min(0)
        mass = residual.sum(dim=-1, keepdim=True)
        rejected = (num_accepted < k)[:, None] & (mass > 0)
        final_dist = torch.where(rejected, residual / mass.clamp_min(1e-30), p_at)
    u_at = u.gather(1, at.expand(-1, 1, vocab + 1)).squeeze(1)[:, :vocab]
    final = _race(final_dist, u_at, greedy)
    tokens = torch.full((b, k1), -1, dtype=torch.long, device=device)
    cols = torch.arange(k1, device=device)[None, :]
    if k:
        tokens[:, :k] = torch.where(cols[:, :k] < num_accepted[:, None], drafts, -1)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return Verdict(tokens, num_accepted)


def _verify_greedy(target_logits: Tensor, drafts: Tensor) -> Verdict:
    """The rule on greedy rows, where every distribution is one-hot on the argmax: accept while the
    draft is the target's argmax, then emit the argmax where the first mismatch (or the bonus) is."""
    b, k1, _ = target_logits.shape
    best = target_logits.argmax(dim=-1)  # [B, k + 1], the lowest id among ties, as `sampling_probs`
    num_accepted = (drafts == best[:, : k1 - 1]).long().cumprod(dim=1).sum(dim=1)
    cols = torch.arange(k1, device=best.device)[None, :]
    tokens = torch.where(cols <= num_accepted[:, None], best, -1)
    return Verdict(tokens, num_accepted)
