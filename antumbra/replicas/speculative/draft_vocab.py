"""The drafter's LM head over a subset of the vocabulary (a draft vocabulary, or token map).

Each draft pass ends in the LM head, which reads the whole [V, D] matrix: at V = 129,280 and width
4096 that is 1 GB in bfloat16 a pass, k passes a step, often more than the target's own step reads at
small batches. Most of what a model says falls in a few tens of thousands of frequent tokens, so the
drafter can score those alone (as FR-Spec and SGLang's `--speculative-token-map` do): its head is
those rows of the target's, gathered once.

Exactness does not depend on the subset: the target verifies every draft. A token outside the
subset is never drafted (its logit is -inf), so a draft that would have been it is lost, not wrong;
a sampled draft's distribution q is the softmax over the subset, and the rejection rule keeps the
target's distribution for any q.

A token map is a JSON file holding a list of token ids (`load_token_map`); `mtp_distill` writes one
from the target's own text (`write_token_map`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..model.model import head_product

TOKEN_MAP_FILE = "draft_vocab.json"


class DraftHead:
    """weight [V, D] the target's LM head; token_ids the draft vocabulary (unique ids in [0, V)).
    Calling it: hidden [N, D] in the weight's dtype -> [N, V] float32 logits, -inf off the subset.

    Invariant: `weight` holds the target head's rows of `token_ids` as of the head's last in-place
    change (a live weight update writes the head in place; `refresh`, called before each draft step,
    gathers again into the same storage, so a captured draft graph reads the new rows)."""

    def __init__(self, weight: torch.Tensor, token_ids: Sequence[int]) -> None:
        vocab = weight.shape[0]
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        if ids.numel() == 0 or ids.unique().numel() != ids.numel():
            raise ValueError("a draft vocabulary needs distinct token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"draft vocabulary ids must lie in [0, {vocab}): got {int(ids.min())} .. "
                             f"{int(ids.max())}")
        self.vocab_size = vocab
        self._source = weight
        self.token_ids = ids.to(weight.device)  # [V'] int64
        self.weight = weight.detach()[self.token_ids].contiguous()  # [V', D]
        self._version = weight._version

    def refresh(self) -> None:
        """Gather the rows again if the target's head changed in place since they were taken."""
        if self._source._version != self._version:
            torch.index_select(self._source.detach(), 0, self.token_ids, out=self.weight)
            self._version = self._source._version

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = head_product(hidden, self.weight)  # [N, V'] float32, as the target's head rounds
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32,
                         device=hidden.device)
        return out.index_copy_(1, self.token_ids, scores)


def load_token_map(path: str | Path) -> list[int]:
    """A token map file: a JSON list of token ids. Raises ValueError naming the file when it is not."""
    path = Path(path)
    try:
        ids = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"speculative token map {path}: {exc}") from exc
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       for i in ids):
        raise ValueError(f"speculative token map {path}: expected a non-empty JSON list of token ids")
    return ids


def write_token_map(path: str | Path, texts: Iterable[Sequence[int]], size: int) -> Path:
    """The `size` most frequent token ids of `texts` (ties: the smaller id first) as a token map file at
    `path` -> the path."""
    counts = Counter(t for text in texts for t in text)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    path = Path(path)
    path.write_text(json.dumps(ranked) + "\n")
    return path
