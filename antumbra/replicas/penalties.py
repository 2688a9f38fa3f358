"""Logit adjustments before the draw: logit bias, repetition / frequency / presence penalties.

For a row with logits l and its request's history (prompt P, generated tokens with counts c_j),
each adjusted token j becomes, in this order (vLLM's, which applies the bias before penalties):

    l_j += bias_j                                               (OpenAI `logit_bias`)
    l_j  = l_j / r if l_j > 0 else l_j * r,   for j in P or c_j > 0     (`repetition_penalty` r)
    l_j -= c_j * frequency + (c_j > 0) * presence               (OpenAI's definitions)

(the subtracted amount is computed in double precision and rounded once to float32, so every
device computes the same value; positive logits are multiplied by 1 / r rounded once to float32).

This module is the host-side definition, from a request's history as the host holds it: a
sparse list with one entry per (row, token) the row touches, sorted by row then token, holding
the token's bias, its repetition factor (1 when unseen) and inverse, and what the two OpenAI
penalties subtract, `sub = c_j * frequency + (c_j > 0) * presence` (`build_entries`). A
min_tokens ban is an entry whose bias is -inf (`with_bans`); `kernels/sampling.adjust_reference`
applies such a list. The engine does not build these lists: it keeps each penalised request's
counts on the device (`penalty_state.py`) and the race reads them there; the tests hold that
path to this definition, token for token. `TokenCounts` keeps a request's counts incrementally,
so a list is built from the tokens a row touches, not its whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .sampling_params import SamplingParams

_PENDING = -1  # a token still on the device (overlap scheduling); never counted


class TokenCounts:
    """One request's token history as the penalties read it: the prompt's distinct ids (once) and
    a running count of each generated id, updated from the request's output list each step.

    `entries(params)` keeps the request's entries as sorted arrays between steps: a step changes
    the one entry of the token it generated (or inserts it), so building a step's entries costs
    a copy of each row's arrays, not a walk over its history."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_ids = frozenset(prompt_token_ids)
        self.counts: dict[int, int] = {}
        self._seen = 0
        self._params: SamplingParams | None = None
        self._tokens = np.zeros(0, dtype=np.int64)
        self._values = np.zeros((4, 0), dtype=np.float64)
        self._changed: set[int] = set()  # generated tokens whose entry is not up to date yet
        self._bias: dict[int, float] = {}

    def update(self, output_token_ids: Sequence[int]) -> TokenCounts:
        """Count the output tokens added since the last update; -> self."""
        for token in output_token_ids[self._seen :]:
            if token == _PENDING:
                break
            self.counts[token] = self.counts.get(token, 0) + 1
            self._changed.add(token)
            self._seen += 1
        return self

    def entries(self, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [n] int64 sorted, values [4, n] float64) of this request under `params`."""
        if params is not self._params:
            self._params, self._changed = params, set()
            self._bias = bias = dict(params.logit_bias)
            touched = set(bias)
            if _tracks_output(params):
                touched.update(self.counts)
            if params.repetition_penalty != 1:
                touched.update(self.prompt_ids)
            self._tokens = np.array(sorted(touched), dtype=np.int64)
            self._values = np.array([self._entry(params, t) for t in self._tokens.tolist()],
                                    dtype=np.float64).reshape(-1, 4).T.copy()
        elif self._changed:
            if _tracks_output(params):
                for token in sorted(self._changed):
                    self._set(params, token)
            self._changed = set()
        return self._tokens, self._values

    def _set(self, params: SamplingParams, token: int) -> None:
        at = int(np.searchsorted(self._tokens, token))
        column = np.array(self._entry(params, token), dtype=np.float64)
        if at < self._tokens.shape[0] and self._tokens[at] == token:
            self._values[:, at] = column
        else:
            self._tokens = np.insert(self._tokens, at, token)
            self._values = np.insert(self._values, at, column, axis=1)

    def _entry(self, params: SamplingParams, token: int) -> tuple[float, float, float, float]:
        count = self.counts.get(token, 0) if _tracks_output(params) else 0
        seen = count > 0 or token in self.prompt_ids
        factor = params.repetition_penalty if seen else 1.0
        sub = count * params.frequency_penalty + (params.presence_penalty if count > 0 else 0.0)
        return self._bias.get(token, 0.0), 1.0 / factor, factor, sub


def _tracks_output(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1)


@dataclass(frozen=True)
class PenaltyEntries:
    """The step's adjustments on the host, sorted by (row, token): `rows` / `tokens` [E] int64 and
    `values` [4, E] float32 (bias, 1 / repetition factor, repetition factor, subtracted penalty:
    the layout `kernels/sampling.adjust_reference` reads)."""

    rows: Tensor
    tokens: Tensor
    values: Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def build_entries(
    params: Sequence[SamplingParams], counts: Sequence[TokenCounts | None]
) -> PenaltyEntries | None:
    """The entries of every row whose params adjust logits; None when no row does.

    counts[i] must be given (and up to date) for each such row."""
    if not any(p.adjusts_logits for p in params):
        return None
    rows, tokens, values = [], [], []
    for row, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        history = counts[row]
        if history is None:
            raise ValueError(f"row {row} has logit adjustments but no token history")
        row_tokens, row_values = history.entries(p)
        rows.append(np.full(row_tokens.shape[0], row, dtype=np.int64))
        tokens.append(row_tokens)
        values.append(row_values)
    return PenaltyEntries(torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(tokens)),
                          torch.from_numpy(np.concatenate(values, axis=1).astype(np.float32)))


def with_bans(entries: PenaltyEntries | None, bans: Sequence[tuple[int, int]]) -> PenaltyEntries | None:
    """`entries` with each banned (row, token) biased to -inf (so it can never be drawn)."""
    if not bans:
        return entries
    if entries is None:
        entries = _entries([], [], [[], [], [], []])
    banned = np.unique(np.array([(r << 32) | t for r, t in bans], dtype=np.int64))
    keys = (entries.rows.numpy() << 32) | entries.tokens.numpy()
    at = np.searchsorted(keys, banned)
    found = at < keys.shape[0]
    found[found] = keys[at[found]] == banned[found]
    values = entries.values.numpy().copy()
    values[0, at[found]] = -np.inf
    missing, where = banned[~found], at[~found]
    column = np.array([[-np.inf], [1.0], [1.0], [0.0]], dtype=np.float32)
    values = np.insert(values, where, np.repeat(column, missing.shape[0], axis=1), axis=1)
    keys = np.insert(keys, where, missing)
    rows, tokens = torch.from_numpy(keys >> 32), torch.from_numpy(keys & 0xFFFFFFFF)
    return PenaltyEntries(rows, tokens, torch.from_numpy(values))


def _entries(rows: list[int], tokens: list[int], columns: list[list[float]]) -> PenaltyEntries:
    values = torch.tensor(columns, dtype=torch.float32).view(4, -1)
    as_long = torch.long
    return PenaltyEntries(torch.tensor(rows, dtype=as_long), torch.tensor(tokens, dtype=as_long), values)
