"""The engine's MTP drafter: keeps each speculating request's MTP window current and drafts its next
tokens after every step.

Per step, for each speculating request in it (`DraftWork`):

1. catch up: the MTP block runs over the positions the target just computed and keeps (a prefill
   chunk's last `window` positions, a decode's one, a verify chunk's accepted ones), reading the
   target's last-layer streams there and the token after each position. That writes the block's
   window rows from the target's own states, replacing whatever its chain wrote at those positions
   last step (`MTPWindowCache`: a position written again replaces its row, the whole rollback a
   rejected draft needs). Its last row predicts the first draft;
2. chain: draft j >= 2 feeds the block's own output streams at the previous draft's position with the
   token drafted there, as `MTPBlock` describes.

Drafts are drawn with `rejection.sample_draft` (the request's seed, salted, and the output index the
drafted token would take), so a request's drafts depend on its seed, its tokens and the weights only.

Invariants: a request drafts only from a ring slot of its own (`slot_of`); slots return on `release`
(finished requests) and run out gracefully (a request without a slot drafts nothing that step). Only
window rows of positions the target has computed from known tokens are read by a catch-up's last row:
a chunk's catch-up covers its last min(len, window) positions, and a request's chunks follow each
other, so every key a query reads was written from the target's states. A prefix-cache hit leaves the
window to compute (`SpecState.catch_up_tokens`) and an adopted request catches up over the streams its
prefill engine sent (`kv_transfer.payload.DRAFT_STREAMS`); an adoption without them (a payload from a
sender not asked for them) reads another sequence's rows until its window refills: drafts are then
worse, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..model.model import DeepseekV4
from ..model.mtp import MTPBlock, MTPWindowCache
from ..sampling_cuts import temperature
from ..sampling_params import SamplingParams
from ..step_io import Drafts
from ..step_result import VerifiedRows
from .draft_graphs import DraftGraphs, DraftRow, greedy_drafts
from .draft_vocab import DraftHead
from .rejection import sample_draft


@dataclass(frozen=True)
class DraftWork:
    """One request's share of a step's drafting."""

    request_id: str
    start: int  # first position to catch up
    hidden: torch.Tensor  # [m, n, D] the target's last-layer streams at positions start .. start + m - 1
    next_ids: list[int]  # [m] the token after each of those positions
    num_drafts: int  # drafts wanted after the catch-up (0: catch up only)
    params: SamplingParams
    seed: int
    first_counter: int  # output index the first draft would take
    num_tokens: int  # the request's token count after this step (what its drafts follow)


class Drafter(Protocol):
    """What makes a speculating request's drafts after each step (`MTPDrafter`, `replay.ReplayDrafter`)."""

    num_drafts: int

    def draft(self, work: list[DraftWork]) -> dict[str, Drafts]: ...

    def release(self, request_id: str) -> None: ...

    def check_integrity(self, live: set[str]) -> None: ...


class MTPDrafter:
    """`graph_sizes`: request counts of the fixed-shape draft step (`draft_graphs.py`), () for none;
    `use_graphs`: replay it from CUDA graphs (else it runs eagerly)."""

    def __init__(self, target: DeepseekV4, block: MTPBlock, num_drafts: int, num_slots: int,
                 graph_sizes: tuple[int, ...] = (), use_graphs: bool = False,
                 head: DraftHead | None = None) -> None:
        self.target = target
        self.block = block
        self.head = head  # the draft vocabulary's head (None: the target's whole head)
        self.num_drafts = num_drafts
        self.window = target.config.sliding_window
        weight = target.lm_head.weight
        self.cache = MTPWindowCache(target.config, num_slots, max(self.window, num_drafts + 1), weight.dtype,
                                    weight.device)
        self._slots: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.graphs = (DraftGraphs(target, block, self.cache, num_drafts, graph_sizes, use_graphs, head)
                       if graph_sizes and num_drafts else None)
        # The cycle launched behind this step's verify step: (request ids, first positions) it drafted
        # for, and its drafts [B, k] on the device; taken by the step's `draft`.
        self._launched: tuple[list[str], list[int], torch.Tensor] | None = None

    # ----- slots -----
    def slot_of(self, request_id: str) -> int | None:
        """The request's ring slot, taken on first use; None when every slot is taken."""
        slot = self._slots.get(request_id)
        if slot is None and self._free:
            slot = self._slots[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self, live: set[str]) -> None:
        taken = sorted(self._slots.values())
        assert len(set(taken)) == len(taken), "two requests share an MTP ring slot"
        assert sorted(taken + self._free) == list(range(self.cache.num_seqs)), "an MTP ring slot went missing"
        assert set(self._slots) <= live, "a finished request keeps its MTP ring slot"

    # ----- one step -----
    @torch.no_grad()
    def launch_after_verify(self, request_ids: list[str], starts: list[int], verified: VerifiedRows) -> None:
        """Launch the next cycle behind a greedy verify step whose chunks (request b's at first position
        starts[b]) all hold k + 1 rows (`DraftGraphs.draft_after_verify`), for the step's `draft` to
        take; nothing when the requests exceed the fixed-shape step or a ring slot."""
        self._launched = None
        graphs = self.graphs
        if graphs is None or not 0 < len(request_ids) <= graphs.max_batch_size:
            return
        slots = [self.slot_of(rid) for rid in request_ids]
        if any(slot is None for slot in slots):
            return
        if self.head is not None:
            self.head.refresh()
        drafts = graphs.draft_after_verify([s for s in slots if s is not None], starts, verified)
        self._launched = (list(request_ids), list(starts), drafts)

    def _take_launched(self, work: list[DraftWork]) -> dict[str, Drafts] | None:
        """The launched cycle's drafts when it drafted for exactly this step's work (each request caught
        up from its verify chunk's first position over at most k + 1 rows), else None."""
        launched, self._launched = self._launched, None
        if launched is None:
            return None
        ids, starts, drafts = launched
        if [w.request_id for w in work] != ids or [w.start for w in work] != starts or any(
                len(w.next_ids) > self.num_drafts + 1 or temperature(w.params) != 0 for w in work):
            return None
        return self._greedy(work, drafts)

    def _greedy(self, work: list[DraftWork], drafts: torch.Tensor) -> dict[str, Drafts]:
        """A fixed-shape cycle's drafts [B, k] (device) as each request's `Drafts`, as many as it wants."""
        counts = [min(w.num_drafts, self.num_drafts) for w in work]
        made = greedy_drafts(drafts, counts, [w.num_tokens for w in work])
        return {w.request_id: d for w, d in zip(work, made, strict=True) if d is not None}

    @torch.no_grad()
    def draft(self, work: list[DraftWork]) -> dict[str, Drafts]:
        """Catch every request up, then draft for those that want drafts -> request id -> its drafts
        (the cycle launched behind the verify step when it covered this work)."""
        work = [w for w in work if w.next_ids and self.slot_of(w.request_id) is not None]
        launched = self._take_launched(work)
        if launched is not None:
            return launched
        if not work:
            return {}
        if self.head is not None:
            self.head.refresh()  # the target's head may have taken a weight update since
        if self.graphs is not None:
            fixed = [DraftRow(self._slots[w.request_id], w.start, w.hidden, w.next_ids) for w in work]
            if self.graphs.eligible(fixed, [temperature(w.params) == 0 for w in work]):
                return self._greedy(work, self.graphs.draft(fixed))
        logits, streams = self._catch_up(work)
        wanting = [i for i, w in enumerate(work) if w.num_drafts > 0]
        tokens: list[list[int]] = [[] for _ in work]
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        for j in range(max((work[i].num_drafts for i in wanting), default=0)):
            if j:
                live = [i for i in wanting if work[i].num_drafts > j]
                logits, streams = self._chain(work, live, wanting, tokens, streams, j)
                wanting = live
            rows = [work[i] for i in wanting]
            drawn, q = sample_draft(logits, [w.params for w in rows], [w.seed for w in rows],
                                    [w.first_counter + j for w in rows])
            for row, i in enumerate(wanting):
                tokens[i].append(int(drawn[row]))
                probs[i].append(q[row])
        return {
            w.request_id: Drafts(tuple(tokens[i]), torch.stack(probs[i]), w.num_tokens)
            for i, w in enumerate(work) if tokens[i]
        }

    def _catch_up(self, work: list[DraftWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [B', V] of the first draft, the block's streams [B', n, D] at each request's last
        caught-up position), rows for the requests that want drafts, in order."""
        slots = [self._slots[w.request_id] for w in work]
        lengths = [len(w.next_ids) for w in work]
        index, positions = self.cache.ragged_index(slots, [w.start for w in work], lengths)
        device = positions.device
        ids = torch.tensor([t for w in work for t in w.next_ids], dtype=torch.long).to(device)
        hidden = torch.cat([w.hidden for w in work])
        ends = torch.tensor(lengths).cumsum(0) - 1
        last = ends[[i for i, w in enumerate(work) if w.num_drafts > 0]].to(device)
        logits, streams = self.block.run(self.target, hidden, ids, index, positions, self.cache, last,
                                         head=self.head)
        return logits, streams[last]

    def _chain(self, work: list[DraftWork], live: list[int], wanting: list[int], tokens: list[list[int]],
               streams: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step j (from 0) for the `live` requests: the block at the position of draft j - 1, reading
        its own streams there (`streams`: rows of `wanting`) and that draft."""
        keep = [wanting.index(i) for i in live]
        slots = [self._slots[work[i].request_id] for i in live]
        starts = [work[i].start + len(work[i].next_ids) - 1 + j for i in live]
        index, positions = self.cache.ragged_index(slots, starts, [1] * len(live))
        ids = torch.tensor([tokens[i][-1] for i in live], dtype=torch.long).to(positions.device)
        rows = torch.tensor(keep, dtype=torch.long).to(streams.device)
        return self.block.run(self.target, streams[rows], ids, index, positions, self.cache, head=self.head)
