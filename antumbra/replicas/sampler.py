"""Batched next-token sampling with per-request settings, on the logits' device.

Every row of a batch can carry different `SamplingParams`. Rows draw with the Gumbel race of
`antumbra/kernels/sampling`: `argmax(l / T + G)` over the tokens a row's cut keeps, `argmax(l)`
for greedy rows. The noise G is a pure function of the row's seed, the number of tokens its
request has sampled and the token id, so there is no generator state to place on a device or
to share between rows: a request's tokens depend only on its seed and its logits, whatever
else is in the batch, where its row sits, which device runs it and whether the step was
replayed from a CUDA graph. The engine gives every request a seed (its own, or one drawn from
the engine's seeded RNG when it has none).

What a row may ask for, applied on the device in this order, each only for the rows that ask:
  1. logit adjustments (`penalties.py` defines them: logit bias, repetition / frequency /
     presence penalties) and the min_tokens ban, from the row's slot of the device-resident
     `PenaltyState` (`penalty_state.py`); then the structured-output hook `allowed_token_mask`
     (tokens a grammar disallows go to -inf);
  2. the cut (`sampling_cuts.py`): top-k then top-p (a sort of the rows that use them), and
     min_p (the row's largest adjusted logit plus a slack);
  3. the race; logprobs are those of the unadjusted logits, for the rows that ask.
On CUDA (`use_kernel`) a step whose rows need no mask and whose sorting rows have no slot runs
1-3 as the race kernel's two launches (`race_sample_slots`: the counts are read beside the
logits) after one small copy of the rows' keys, slack and slot ids to the device; otherwise the
adjusted logits are built as a copy (the kernels' PyTorch reference), cut and raced. The host
reads back the token ids once. `distribution` gives the probabilities the race draws from, for
tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from antumbra.kernels.sampling import (
    AdjustedWorkspace,
    RaceWorkspace,
    SlotTables,
    adjust_slots_reference,
    empty_tables,
    min_p_floor_reference,
    pack_rows,
    race_sample,
    race_sample_reference,
    race_sample_slots,
)
from antumbra.kernels.token_mask import apply_token_mask, apply_token_mask_reference
from antumbra.replicas.penalty_state import ResidentRows, needs_slot
from antumbra.replicas.sampling_cuts import filters, min_p_slack, sorts, temperature, top_k_top_p_floor
from antumbra.replicas.sampling_params import SamplingParams


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
    resident: ResidentRows | None = None  # the rows' penalty slots (None: no row adjusts logits)
    slack: Tensor | None = None  # [B] float32 min_p slack (`sampling_cuts`); None: no row uses min_p
    # Whether the race over per-slot tables draws every row by itself (no row sorts for a top-k /
    # top-p cut), which a decode graph's race does (`graph_race.py`).
    in_graph: bool = True

    @staticmethod
    def build(
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        output_token_counts: Sequence[int],
        resident: ResidentRows | None = None,
    ) -> SamplingRows:
        """`output_token_counts[i]`: tokens row i's request has sampled (the noise counter, and
        what `min_tokens` compares with); `resident`: the rows' slots (`PenaltyState.rows_for`),
        needed by rows that adjust logits or are short of min_tokens."""
        batch = len(params)
        for name, seq in (("seeds", seeds), ("output_token_counts", output_token_counts)):
            if len(seq) != batch:
                raise ValueError(f"{name} has {len(seq)} entries for a batch of {batch} rows")
        slots = resident.slots.tolist() if resident is not None else None
        if slots is not None and len(slots) != batch:
            raise ValueError(f"resident has {len(slots)} slots for a batch of {batch} rows")
        # One pass over the rows (a decode step builds every row, every step).
        plain, min_p, in_graph = True, False, True
        for row, (p, count) in enumerate(zip(params, output_token_counts, strict=True)):
            slotted = needs_slot(p, count)
            if slotted and (slots is None or slots[row] < 0):
                raise ValueError(f"row {row} adjusts its logits (penalties, logit_bias, min_tokens) but "
                                 "has no penalty slot")
            cut = filters(p)
            plain = plain and not (cut or slotted)
            min_p = min_p or (cut and p.min_p > 0)
            in_graph = in_graph and not (cut and sorts(p))  # a sorting row is a cut one
        packed = pack_rows(list(seeds), list(output_token_counts), [temperature(p) for p in params])
        slack = min_p_slack(params) if min_p else None
        return SamplingRows(tuple(params), tuple(output_token_counts), packed, plain, resident, slack,
                            in_graph)

    def spread(self, at: Sequence[int], count: int) -> Tensor:
        """-> packed [4, count] int32 on the host: row i's settings at position at[i], zero elsewhere
        (zero keys and temperature: those positions draw their argmax, which nobody reads)."""
        if len(at) != len(self.params):
            raise ValueError(f"{len(at)} positions for {len(self.params)} rows")
        spread = torch.zeros(4, count, dtype=self.packed.dtype)
        spread[:, list(at)] = self.packed
        return spread

    def slotted(self) -> set[int]:
        """The rows that have a penalty slot."""
        if self.resident is None:
            return set()
        return {row for row, slot in enumerate(self.resident.slots.tolist()) if slot >= 0}


class Sampler:
    """Samples [B, V] logits on their device; `use_kernel` picks the Triton kernels over their
    PyTorch references."""

    def __init__(self, use_kernel: bool = False) -> None:
        self.use_kernel = use_kernel
        self._workspace: RaceWorkspace | None = None
        self._adjusted_workspace: AdjustedWorkspace | None = None
        self._no_slots: SlotTables | None = None

    def sample(self, logits: Tensor, rows: SamplingRows) -> SamplerOutput:
        """logits: [B, V] float (not modified) -> one token per row, and the logprobs asked for."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                f"logits must be a [B, V] float tensor, got {tuple(logits.shape)} {logits.dtype}"
            )
        if logits.shape[0] != len(rows.params):
            raise ValueError(f"params has {len(rows.params)} entries for a batch of {logits.shape[0]} rows")
        if not rows.params:
            return SamplerOutput([], [])
        tokens = self.sample_tokens(logits, rows).tolist()
        return SamplerOutput(tokens, gather_logprobs(logits, rows.params, tokens))

    def sample_tokens(
        self, logits: Tensor, rows: SamplingRows, allowed_token_mask: Tensor | None = None
    ) -> Tensor:
        """-> [B] int64 token ids on logits.device (no host synchronisation). The rows' slots are
        read, not counted: the caller records the drawn tokens (`PenaltyState.record`).

        `allowed_token_mask` is the structured-output hook: per row, the tokens a grammar allows,
        as bool [B, V] (True: allowed) or a packed int32 bitmask [B, ceil(V / 32)] (bit j % 32 of
        word j // 32, the layout llguidance and xgrammar fill); disallowed tokens get -inf after
        the penalties and before the cut. A step that passes one must not sample in a decode
        graph (its rows are not `plain`)."""
        adjusts = rows.resident is not None or rows.slack is not None
        if self.use_kernel and allowed_token_mask is None and adjusts:
            sorting = {r for r, p in enumerate(rows.params) if sorts(p)}
            if not sorting & rows.slotted():
                return self._race_adjusted(logits, rows)
        adjusted, floor = self._prepared(logits, rows, allowed_token_mask)
        packed = rows.packed.to(adjusted.device, non_blocking=True)  # [4, B] int32
        if self.use_kernel:
            return race_sample(adjusted, packed, floor, workspace=self._workspace_for(adjusted))
        return race_sample_reference(adjusted, packed, floor)

    def distribution(
        self, logits: Tensor, rows: SamplingRows, allowed_token_mask: Tensor | None = None
    ) -> Tensor:
        """[B, V] float32: the probabilities each row's draw follows (a greedy row: one-hot on its
        argmax, the lowest id among ties), as `sample_tokens` sees the logits."""
        adjusted, floor = self._prepared(logits, rows, allowed_token_mask)
        temps = torch.tensor([temperature(p) for p in rows.params], dtype=torch.float32).to(adjusted.device)
        kept = adjusted.masked_fill(adjusted < floor[:, None], float("-inf"))
        greedy = temps == 0
        scaled = kept / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        probs = torch.softmax(scaled, dim=-1)
        one_hot = torch.zeros_like(probs).scatter_(1, kept.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where(greedy[:, None], one_hot, probs)

    def _prepared(self, logits: Tensor, rows: SamplingRows, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """(adjusted logits [B, V] float32, a copy only when some row is adjusted; each row's
        threshold [B] float32 on them, -inf: no cut)."""
        adjusted = logits.float()
        resident = rows.resident
        if resident is not None or mask is not None:
            adjusted = adjusted.clone()
        if resident is not None:
            device = adjusted.device
            counters = rows.packed[2].to(device).long()
            slots = resident.slots.to(device).long()
            adjust_slots_reference(adjusted, counters, slots, resident.state.tables)
        if mask is not None:
            _apply_allowed(adjusted, mask)
        floor = top_k_top_p_floor(adjusted, rows.params)
        if floor is None:
            floor = torch.full((adjusted.shape[0],), float("-inf"), device=adjusted.device)
        if rows.slack is not None:
            floor = torch.maximum(floor, min_p_floor_reference(adjusted, rows.slack.to(adjusted.device)))
        return adjusted, floor

    def _race_adjusted(self, logits: Tensor, rows: SamplingRows) -> Tensor:
        """The fused path: the step's rows, slack and slot ids in one copy to the device, then the
        race kernel's two launches over the slots' tables. Rows that sort have no slot here, so
        their cut is taken on the logits as they are."""
        batch, vocab = logits.shape
        resident = rows.resident
        slack = rows.slack if rows.slack is not None else torch.full((batch,), float("-inf"))
        slots = resident.slots if resident is not None else torch.full((batch,), -1, dtype=torch.int32)
        host = torch.cat([rows.packed.reshape(-1), slack.view(torch.int32), slots])  # [6B] int32
        packed, slack_d, slots_d = host.to(logits.device, non_blocking=True).split([4 * batch, batch, batch])
        tables = resident.state.tables if resident is not None else self._empty_tables(logits)
        floor = top_k_top_p_floor(logits.float(), rows.params)
        return race_sample_slots(
            logits, packed.view(4, batch), floor, slack_d.view(torch.float32), slots_d, tables,
            resident.search if resident is not None else 4, workspace=self._adjusted_workspace_for(logits),
        )

    def _empty_tables(self, logits: Tensor) -> SlotTables:
        """One empty slot for steps whose rows have none (min_p only): the kernel's tables."""
        tables = self._no_slots
        vocab = logits.shape[1]
        if tables is None or tables.counts.device != logits.device or tables.counts.shape[1] != vocab:
            tables = self._no_slots = empty_tables(1, vocab, 1, logits.device)
        return tables

    def _workspace_for(self, logits: Tensor) -> RaceWorkspace:
        ws = self._workspace
        rows, vocab = logits.shape
        if ws is None or ws.values.shape[0] < rows or ws.values.device != logits.device:
            ws = self._workspace = RaceWorkspace(max(rows, 64), vocab, logits.device)
        return ws

    def _adjusted_workspace_for(self, logits: Tensor) -> AdjustedWorkspace:
        ws = self._adjusted_workspace
        rows, vocab = logits.shape
        if ws is None or ws.ids.shape[0] < rows or ws.ids.device != logits.device or ws.vocab != vocab:
            ws = self._adjusted_workspace = AdjustedWorkspace(max(rows, 64), vocab, logits.device)
        return ws


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
