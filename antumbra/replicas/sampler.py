"""Batched next-token sampling with per-request settings, on the logits' device.

Every row of a batch can carry different `SamplingParams`. Rows draw with the Gumbel race of
`antumbra/kernels/sampling`: `argmax(l / T + G)` over the tokens a row's top-k / top-p cut
keeps, `argmax(l)` for greedy rows. The noise G is a pure function of the row's seed, the
number of tokens its request has sampled and the token id, so there is no generator state to
place on a device or to share between rows: a request's tokens depend only on its seed and its
logits, whatever else is in the batch, where its row sits, which device runs it and whether the
step was replayed from a CUDA graph. The engine gives every request a seed (its own, or one
drawn from the engine's seeded RNG when it has none).

Work per batch on the device, each part only for the rows that need it:
  1. logit adjustments (`penalties.py`: logit bias, repetition / frequency / presence
     penalties) as one sparse gather / scatter, the min_tokens ban, and the structured-output
     hook `allowed_token_mask` (tokens a grammar disallows go to -inf), on one copy of the logits;
  2. the cut as one raw-logit threshold per row: top-k then top-p (a sort of the rows that use
     them), and min_p (a row max: p_j >= min_p * p_max  <=>  l_j >= max(l) + T * ln(min_p)),
     the stricter threshold winning, which is top-p before min_p as transformers orders them;
  3. the race (the Triton kernel on CUDA, its PyTorch reference elsewhere), and the logprobs
     (of the unadjusted logits) of the rows that ask for them.
The host reads back the token ids once. `distribution` gives the probabilities the race draws
from, for tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from antumbra.kernels.sampling import RaceWorkspace, pack_rows, race_sample, race_sample_reference
from antumbra.kernels.token_mask import apply_token_mask, apply_token_mask_reference
from antumbra.replicas.penalties import PenaltyEntries, TokenCounts, apply_entries, build_entries
from antumbra.replicas.sampling_params import SamplingParams

# Below this temperature logits / T overflows fp32 for ordinary logit ranges, and the
# distribution is a point mass to fp32 precision anyway, so such rows are decoded greedily.
_GREEDY_TEMPERATURE = 1e-5


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    # Per row: {chosen token: logprob, each top-N token: logprob}, or None when not requested.
    logprobs: list[dict[int, float] | None]


@dataclass(frozen=True)
class SamplingRows:
    """A batch's sampling settings as the race reads them, built on the host.

    `packed` is one [4, B] int32 tensor (seed halves, token counter, temperature's float32 bits:
    `kernels/sampling.pack_rows`) so the device needs a single copy; `plain` rows need no ban,
    no adjustment and no cut, which is what a captured decode graph samples by itself.
    """

    params: tuple[SamplingParams, ...]
    output_token_counts: tuple[int, ...]
    packed: Tensor  # [4, B] int32 on the host
    plain: bool
    penalties: PenaltyEntries | None = None  # the rows' logit adjustments (None: no row has any)

    @staticmethod
    def build(
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        output_token_counts: Sequence[int],
        histories: Sequence[TokenCounts | None] | None = None,
    ) -> SamplingRows:
        """`output_token_counts[i]`: tokens row i's request has sampled (the noise counter, and
        what `min_tokens` compares with); `histories[i]`: its token counts, needed by rows whose
        params adjust logits (penalties, logit bias)."""
        batch = len(params)
        for name, seq in (("seeds", seeds), ("output_token_counts", output_token_counts)):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} entries for a batch of {batch} rows")
        packed = pack_rows(list(seeds), list(output_token_counts), [_temperature(p) for p in params])
        plain = not any(
            _filters(p) or p.adjusts_logits or count < p.min_tokens
            for p, count in zip(params, output_token_counts, strict=True)
        )
        penalties = build_entries(params, histories if histories is not None else [None] * batch)
        return SamplingRows(tuple(params), tuple(output_token_counts), packed, plain, penalties)

    def bans(self, eos_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(row, token) pairs excluded because the row is still short of `min_tokens`: its stop
        tokens and the model's end-of-sequence ids."""
        pairs: list[tuple[int, int]] = []
        for row, (p, count) in enumerate(zip(self.params, self.output_token_counts, strict=True)):
            if count < p.min_tokens:
                pairs.extend((row, t) for t in sorted(set(eos_token_ids).union(p.stop_token_ids)))
        return pairs


def _temperature(p: SamplingParams) -> float:
    return 0.0 if p.temperature < _GREEDY_TEMPERATURE else float(p.temperature)


def _filters(p: SamplingParams) -> bool:
    """Whether the row's draw is cut (top-k, top-p or min_p; greedy rows are never cut)."""
    return _temperature(p) > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)


def _sorts(p: SamplingParams) -> bool:
    return _temperature(p) > 0 and (p.top_k > 0 or p.top_p < 1)


class Sampler:
    """Samples [B, V] logits on their device; `use_kernel` picks the Triton race over its reference."""

    def __init__(self, use_kernel: bool = False) -> None:
        self.use_kernel = use_kernel
        self._workspace: RaceWorkspace | None = None

    def sample(self, logits: Tensor, rows: SamplingRows, eos_token_ids: Sequence[int]) -> SamplerOutput:
        """logits: [B, V] float (not modified) -> one token per row, and the logprobs asked for."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                f"logits must be a [B, V] float tensor, got {tuple(logits.shape)} {logits.dtype}"
            )
        if logits.shape[0] != len(rows.params):
            raise ValueError(f"params has {len(rows.params)} entries for a batch of {logits.shape[0]} rows")
        if not rows.params:
            return SamplerOutput([], [])
        tokens = self.sample_tokens(logits, rows, eos_token_ids).tolist()
        return SamplerOutput(tokens, gather_logprobs(logits, rows.params, tokens))

    def sample_tokens(
        self,
        logits: Tensor,
        rows: SamplingRows,
        eos_token_ids: Sequence[int],
        allowed_token_mask: Tensor | None = None,
    ) -> Tensor:
        """-> [B] int64 token ids on logits.device (no host synchronisation).

        `allowed_token_mask` is the structured-output hook: per row, the tokens a grammar allows,
        as bool [B, V] (True: allowed) or a packed int32 bitmask [B, ceil(V / 32)] (bit j % 32 of
        word j // 32, the layout llguidance and xgrammar fill); disallowed tokens get -inf after
        the penalties and before the cut. A step that passes one must not sample in a decode
        graph (its rows are not `plain`)."""
        adjusted, min_logit = self._prepared(logits, rows, eos_token_ids, allowed_token_mask)
        packed = rows.packed.to(adjusted.device, non_blocking=True)  # [4, B] int32
        if self.use_kernel:
            return race_sample(adjusted, packed, min_logit, workspace=self._workspace_for(adjusted))
        return race_sample_reference(adjusted, packed, min_logit)

    def distribution(
        self,
        logits: Tensor,
        rows: SamplingRows,
        eos_token_ids: Sequence[int],
        allowed_token_mask: Tensor | None = None,
    ) -> Tensor:
        """[B, V] float32: the probabilities each row's draw follows (a greedy row: one-hot on its
        argmax, the lowest id among ties), as `sample_tokens` sees the logits."""
        adjusted, min_logit = self._prepared(logits, rows, eos_token_ids, allowed_token_mask)
        temps = torch.tensor([_temperature(p) for p in rows.params], dtype=torch.float32).to(adjusted.device)
        kept = adjusted.masked_fill(adjusted < min_logit[:, None], float("-inf"))
        greedy = temps == 0
        scaled = kept / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        probs = torch.softmax(scaled, dim=-1)
        one_hot = torch.zeros_like(probs).scatter_(1, kept.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where(greedy[:, None], one_hot, probs)

    def _prepared(
        self, logits: Tensor, rows: SamplingRows, eos_token_ids: Sequence[int], mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """(adjusted logits [B, V] float32, a copy only when some row is adjusted; each row's
        raw-logit threshold [B] float32, -inf: no cut)."""
        adjusted = adjust_logits(logits.float(), rows, eos_token_ids, mask)
        return adjusted, _cut_thresholds(adjusted, rows.params)

    def _workspace_for(self, logits: Tensor) -> RaceWorkspace:
        ws = self._workspace
        rows, vocab = logits.shape
        if ws is None or ws.values.shape[0] < rows or ws.values.device != logits.device:
            ws = self._workspace = RaceWorkspace(max(rows, 64), vocab, logits.device)
        return ws


def adjust_logits(
    raw: Tensor, rows: SamplingRows, eos_token_ids: Sequence[int], mask: Tensor | None = None
) -> Tensor:
    """raw [B, V] float32 with the rows' bias and penalties, min_tokens bans and grammar mask
    applied; `raw` itself (not copied) when there is nothing to apply."""
    bans = rows.bans(eos_token_ids)
    if rows.penalties is None and not bans and mask is None:
        return raw
    out = raw.clone()
    if rows.penalties is not None:
        apply_entries(out, rows.penalties)
    if bans:
        vocab = raw.shape[1]
        for _, t in bans:
            if not 0 <= t < vocab:
                raise ValueError(f"stop/eos token id {t} is outside the vocabulary [0, {vocab})")
        index = torch.tensor(bans, dtype=torch.long).to(raw.device)
        out[index[:, 0], index[:, 1]] = float("-inf")
    if mask is not None:
        _apply_allowed(out, mask)
    return out


def _apply_allowed(logits: Tensor, mask: Tensor) -> None:
    """Disallowed tokens of logits [B, V] float32 to -inf, in place, from a bool [B, V] mask or a
    packed int32 bitmask [B, ceil(V / 32)] (`kernels/token_mask`: its Triton kernel on CUDA)."""
    vocab = logits.shape[1]
    if mask.dtype == torch.bool:
        logits.masked_fill_(~mask.to(logits.device), float("-inf"))
        return
    if mask.dtype != torch.int32 or mask.shape[1] * 32 < vocab:
        raise ValueError(f"allowed_token_mask must be bool [B, V] or int32 [B, ceil(V/32)], got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    apply = apply_token_mask if logits.is_cuda else apply_token_mask_reference
    apply(logits, mask.to(logits.device, non_blocking=True), out=logits)


def _cut_thresholds(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """[B] float32: the smallest raw logit each row's cut keeps (-inf: no cut)."""
    out = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
    _top_k_top_p(logits, params, out)
    rows = [i for i, p in enumerate(params) if _filters(p) and p.min_p > 0]
    if rows:
        index = torch.tensor(rows, dtype=torch.long).to(logits.device)
        # p_j / p_max = exp((l_j - max l) / T) >= min_p: a threshold on raw logits, no sort.
        slack = torch.tensor([_temperature(params[i]) * math.log(params[i].min_p) for i in rows],
                             dtype=torch.float32).to(logits.device)
        bar = logits[index].amax(dim=-1) + slack
        out[index] = torch.maximum(out[index], bar)
    return out


def _top_k_top_p(logits: Tensor, params: Sequence[SamplingParams], out: Tensor) -> None:
    """Write into out [B] the smallest raw logit each row's top-k / top-p cut keeps.

    The cut is taken on raw logits because dividing by T keeps their order: comparing stored
    values never drops the token that defines the threshold, which a comparison of l / T
    recomputed elsewhere could (the division need not round alike everywhere). Tokens tied
    with the threshold are kept. logits: [B, V] float32.
    """
    vocab = logits.shape[1]
    rows = [i for i, p in enumerate(params) if _sorts(p)]
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long).to(logits.device)
    sorted_raw, _ = logits[index].sort(dim=-1, descending=True)  # [F, V]
    positions = torch.arange(vocab, device=logits.device)
    top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows])
    kept = positions[None, :] < top_k.to(logits.device)[:, None]  # [F, V] inside the top-k
    temps = torch.tensor([_temperature(params[i]) for i in rows], dtype=torch.float32).to(logits.device)
    probs = torch.softmax((sorted_raw / temps[:, None]).masked_fill(~kept, float("-inf")), dim=-1)
    # Keep a token while the better ones have not yet reached top_p: the smallest prefix whose
    # mass is >= top_p. top_p == 1 gets an unreachable bar (fp32 sums can creep past 1.0).
    bar = torch.tensor([params[i].top_p if params[i].top_p < 1 else float("inf") for i in rows])
    mass_before = probs.cumsum(dim=-1) - probs
    kept &= mass_before < bar.to(logits.device)[:, None]
    kept[:, 0] = True  # the best token always survives
    last = kept.sum(dim=-1) - 1  # kept positions form a prefix of the sorted row
    out[index] = sorted_raw.gather(1, last[:, None]).squeeze(1)


def gather_logprobs(
    raw: Tensor, params: Sequence[SamplingParams], tokens: list[int]
) -> list[dict[int, float] | None]:
    """Logprobs from the unprocessed logits, which is what clients compare with a reference model.

    raw: [B, V] float.
    """
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.long).to(raw.device)
    logprobs = torch.log_softmax(raw.float()[index], dim=-1)  # [L, V] float32
    chosen = torch.tensor([tokens[i] for i in rows], dtype=torch.long).to(raw.device)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    n_max = min(max(params[i].logprobs or 0 for i in rows), raw.shape[1])
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n_max > 0:
        values, ids = logprobs.topk(n_max, dim=-1)  # [L, n_max] each, best first
        top_lp, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        entry = {tokens[i]: chosen_lp[j]}
        entry.update(zip(top_ids[j][:n], top_lp[j][:n], strict=True))
        out[i] = entry
    return out
