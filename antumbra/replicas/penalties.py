"""Logit adjustments before the draw: logit bias, repetition / frequency / presence penalties.

For a row with logits l and its request's history (prompt P, generated tokens with counts c_j),
each adjusted token j becomes, in this order (vLLM's, which applies the bias before penalties):

    l_j += bias_j                                               (OpenAI `logit_bias`)
    l_j  = l_j / r if l_j > 0 else l_j * r,   for j in P or c_j > 0     (`repetition_penalty` r)
    l_j -= c_j * frequency + (c_j > 0) * presence               (OpenAI's definitions)

Only the tokens a row touches change, so the host sends a sparse list: one entry per (row,
token) with the token's count, whether it was seen, its bias and the row's three penalties
(`build_entries`), and the device applies them in one gather / compute / scatter over that list
(`apply_entries`). Rows without adjustments add no entry. A request's generated-token counts
are kept incrementally (`TokenCounts`), so building a step's entries walks the tokens each row
touches, not its whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling_params import SamplingParams

_PENDING = -1  # a token still on the device (overlap scheduling); never counted


class TokenCounts:
    """One request's token history as the penalties read it: the prompt's distinct ids (once) and
    a running count of each generated id, updated from the request's output list each step."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_ids = frozenset(prompt_token_ids)
        self.counts: dict[int, int] = {}
        self._seen = 0

    def update(self, output_token_ids: Sequence[int]) -> TokenCounts:
        """Count the output tokens added since the last update; -> self."""
        for token in output_token_ids[self._seen :]:
            if token == _PENDING:
                break
            self.counts[token] = self.counts.get(token, 0) + 1
            self._seen += 1
        return self


@dataclass(frozen=True)
class PenaltyEntries:
    """The step's adjustments on the host: `index` [2, E] int64 (row, token) and `values` [5, E]
    float32 (bias, repetition penalty or 1 when unseen, generated count, frequency, presence)."""

    index: Tensor
    values: Tensor

    @property
    def size(self) -> int:
        return int(self.index.shape[1])


def build_entries(
    params: Sequence[SamplingParams], counts: Sequence[TokenCounts | None]
) -> PenaltyEntries | None:
    """The entries of every row whose params adjust logits; None when no row does.

    counts[i] must be given (and up to date) for each such row."""
    if not any(p.adjusts_logits for p in params):
        return None
    rows: list[int] = []
    tokens: list[int] = []
    columns: list[list[float]] = [[], [], [], [], []]
    for row, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        history = counts[row]
        if history is None:
            raise ValueError(f"row {row} has logit adjustments but no token history")
        bias = dict(p.logit_bias)
        generated = history.counts if (p.frequency_penalty or p.presence_penalty or
                                       p.repetition_penalty != 1) else {}
        touched = set(bias).union(generated)
        if p.repetition_penalty != 1:
            touched.update(history.prompt_ids)
        for token in sorted(touched):
            count = generated.get(token, 0)
            seen = count > 0 or token in history.prompt_ids
            rows.append(row)
            tokens.append(token)
            columns[0].append(bias.get(token, 0.0))
            columns[1].append(p.repetition_penalty if seen else 1.0)
            columns[2].append(float(count))
            columns[3].append(p.frequency_penalty)
            columns[4].append(p.presence_penalty)
    return PenaltyEntries(torch.tensor([rows, tokens], dtype=torch.long).view(2, -1),
                          torch.tensor(columns, dtype=torch.float32).view(5, -1))


def apply_entries(logits: Tensor, entries: PenaltyEntries) -> None:
    """Adjust logits [B, V] float32 in place at the entries' (row, token) positions."""
    if entries.size == 0:
        return
    vocab = logits.shape[1]
    if int(entries.index[1].max()) >= vocab:
        raise ValueError(f"a logit_bias / history token id is outside the vocabulary [0, {vocab})")
    index = entries.index.to(logits.device, non_blocking=True)
    bias, rep, count, frequency, presence = entries.values.to(logits.device, non_blocking=True)
    value = logits[index[0], index[1]] + bias
    value = torch.where(value > 0, value / rep, value * rep)
    value = value - count * frequency - (count > 0).float() * presence
    logits[index[0], index[1]] = value
