"""A drafter that replays a reference run's tokens, each kept with a chosen probability.

It charts decode speed against accept length without a trained draft block: each request's drafts are
its reference continuation (the same engine's greedy output, `reference_of(request_id)`), and the draft
for output index i is replaced by another token when a hash of (seed, request id, i) falls below
`1 - keep_rate`. The corruption is a fixed function of the position, so a position redrafted after a
rejection is wrong again and the target's own token takes its place. Under greedy decoding a kept
draft equals the target's choice and is accepted, so with k drafts the accept length is
1 + r + r^2 + ... + r^k for keep rate r (near-ties aside).

It follows `MTPDrafter`'s interface (`draft`, `release`, `check_integrity`, `num_drafts`) and costs
no forward: what a chart made with it shows is the target's side of speculation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from ..model.forward_batch import to_device
from ..step_io import Drafts
from .drafter import DraftWork


class ReplayDrafter:
    def __init__(self, reference_of: Callable[[str], list[int] | None], num_drafts: int, keep_rate: float,
                 vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        if not 0 <= keep_rate <= 1:
            raise ValueError(f"keep_rate must be in [0, 1], got {keep_rate!r}")
        self.reference_of = reference_of
        self.num_drafts = num_drafts
        self.keep_rate = keep_rate
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.seed = seed

    def kept(self, request_id: str, index: int) -> bool:
        """Whether the draft for output index `index` of the request is the reference's token."""
        digest = hashlib.blake2b(f"{self.seed}:{request_id}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.keep_rate

    def draft(self, work: list[DraftWork]) -> dict[str, Drafts]:
        drafted: list[tuple[DraftWork, list[int]]] = []
        for w in work:
            reference = self.reference_of(w.request_id) or []
            indices = range(w.first_counter, min(w.first_counter + w.num_drafts, len(reference)))
            tokens = [reference[i] if self.kept(w.request_id, i) else (reference[i] + 1) % self.vocab_size
                      for i in indices]
            if tokens:
                drafted.append((w, tokens))
        if not drafted:
            return {}
        # Every request's one-hot distributions in one tensor, filled by one scatter.
        flat = [t for _, tokens in drafted for t in tokens]
        probs = torch.zeros(len(flat), self.vocab_size, device=self.device)
        probs.scatter_(1, to_device(flat, self.device)[:, None], 1.0)
        out, row = {}, 0
        for w, tokens in drafted:
            out[w.request_id] = Drafts(tuple(tokens), probs[row : row + len(tokens)], w.num_tokens)
            row += len(tokens)
        return out

    def release(self, request_id: str) -> None:
        """Nothing is held per request."""

    def check_integrity(self, live: set[str]) -> None:
        """Nothing is held per request."""
