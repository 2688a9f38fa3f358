"""The MTP drafter's steady step as one fixed-shape computation, replayed from a CUDA graph per size.

After a verify step each speculating request catches up over at most k + 1 positions (its accepted
drafts and the token the step emitted) and chains k - 1 more drafts (`drafter.py`). Here that cycle is
one fixed-shape step over B requests padded to a graph size, each with C = k + 1 catch-up rows:

1. the block over the B x C catch-up rows (the target's streams there and the token after each
   position); a request's rows past its own count are inactive: they read no key and write only the
   ring's scratch row (`MTPWindowCache.fixed_index`);
2. at each request's last active row, the head's logits and their argmax: draft 1;
3. k - 1 times, the block over B rows at the next position, fed its own output streams and the draft
   just made, and the argmax again.

After a greedy verify step whose chunks all hold k + 1 rows (request b's at rows b * C ..), the cycle can
be launched behind that step without the host reading its verdict (`draft_after_verify`): request b's
accepted count a is the length of the run of its drafts equal to the step's argmax at the position
before each, its catch-up rows are its first a + 1 verify rows (their streams, the argmax at each as
the token after it), its last row b * C + a. The device computes those from the step's rows
(`VerifiedRows`); the host writes only the positions, ring bases and which requests are live, while
the verify step runs. Each row it makes active, and each input of an active row, is the one the host
would write after reading the verdict, so the ring rows written and the drafts are the same.

Rows are greedy only: a greedy row's draft is the argmax of the block's logits and its distribution
one-hot, which is what `rejection.sample_draft` gives it, so a drafted token does not depend on the
path that drafted it. Requests that sample, catch-ups longer than C (the first after a prefill chunk)
and steps with more requests than the largest size take the eager path.

Invariants: the host writes every input (ids, positions, active flags, ring bases, each request's last
catch-up row) into one pinned buffer copied in one transfer, and the target's streams into a static
buffer, before the replay; the graph reads nothing else that changes between steps, and every ring row
it writes is one the eager path would write at the same position (rows past a request's count only
to the scratch row).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..device_events import recorded_event
from ..late_tokens import LateRead, LateTokenIds
from ..model.model import DeepseekV4
from ..model.mtp import MTPBlock, MTPWindowCache
from ..step_io import Drafts
from ..step_result import VerifiedRows
from .draft_vocab import DraftHead


@dataclass(frozen=True)
class DraftRow:
    """One request's share of a fixed-shape draft step."""

    slot: int  # its ring slot in the window cache
    start: int  # first position to catch up
    hidden: torch.Tensor  # [m, n, D] the target's last-layer streams at positions start .. start + m - 1
    next_ids: list[int]  # [m] the token after each of those positions, 1 <= m <= k + 1


class DraftGraphs:
    """`batch_sizes`: request counts the step is built for; `use_graphs`: capture and replay CUDA graphs
    (else the same step runs eagerly, as on a CPU)."""

    def __init__(self, target: DeepseekV4, block: MTPBlock, cache: MTPWindowCache, num_drafts: int,
                 batch_sizes: tuple[int, ...], use_graphs: bool, head: DraftHead | None = None) -> None:
        self.target = target
        self.block = block
        self.head = head  # the draft vocabulary's head (None: the target's whole head)
        self.cache = cache
        self.num_drafts = num_drafts
        self.rows_per_request = num_drafts + 1
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.use_graphs = use_graphs
        weight = target.lm_head.weight
        self.device = weight.device
        biggest = self.batch_sizes[-1] * self.rows_per_request
        cfg = target.config
        self.hidden = torch.zeros(biggest, cfg.hc_mult, cfg.hidden_size, dtype=weight.dtype,
                                  device=self.device)  # [C * B, n, D] the target's streams
        # Rows: 0 token ids, 1 positions, 2 active, 3 ring base (slot * R) of every catch-up row;
        # row 4's first B entries: each request's last active catch-up row.
        pinned = self.device.type == "cuda"
        self._packed = torch.zeros(5, biggest, dtype=torch.long, device=self.device)
        self._host = torch.zeros(5, biggest, dtype=torch.long, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.num_steps = 0
        self.num_after_verify = 0  # of those, cycles launched behind their verify step

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def eligible(self, rows: list[DraftRow], greedy: list[bool]) -> bool:
        return (
            0 < len(rows) <= self.max_batch_size
            and all(greedy)
            and all(1 <= len(r.next_ids) <= self.rows_per_request for r in rows)
        )

    def draft(self, rows: list[DraftRow]) -> torch.Tensor:
        """-> drafts [len(rows), k] int64 on the device, row b for rows[b]; writes the ring rows of every
        catch-up and draft position."""
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(rows))]
        self._write(rows, size)
        self.num_steps += 1
        if not self.use_graphs:
            return self._step(size)[: len(rows)]
        graph, drafts = self._graphs.get((size,)) or self._capture((size,), lambda: self._step(size))
        graph.replay()
        return drafts[: len(rows)]

    def draft_after_verify(self, slots: list[int], starts: list[int], verified: VerifiedRows) -> torch.Tensor:
        """The cycle behind a greedy verify step of k + 1 rows for each of len(slots) requests (request
        b: ring slot slots[b], its verify chunk's first position starts[b]) -> drafts [len(slots), k]
        int64 on the device; nothing waits for the device."""
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(slots))]
        self._write_live(slots, starts, size)
        self.num_steps += 1
        self.num_after_verify += 1
        if not self.use_graphs:
            return self._after_verify(size, verified)[: len(slots)]
        key = (size, verified.streams.data_ptr(), verified.streams.shape[0], verified.argmax.data_ptr(),
               verified.token_ids.data_ptr())
        graph, drafts = (self._graphs.get(key)
                         or self._capture(key, lambda: self._after_verify(size, verified)))
        graph.replay()
        return drafts[: len(slots)]

    def _write(self, rows: list[DraftRow], size: int) -> None:
        c = self.rows_per_request
        n = size * c
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the pinned buffer
        host = self._host
        host[:, :n] = 0
        host[3, :n] = self.cache.pools.scratch_swa_row  # inactive rows: any in-range base
        r = self.cache.rows_per_seq
        for b, row in enumerate(rows):
            m = len(row.next_ids)
            r0 = b * c
            host[0, r0 : r0 + m] = torch.tensor(row.next_ids, dtype=torch.long)
            host[1, r0 : r0 + m] = torch.arange(row.start, row.start + m)
            host[2, r0 : r0 + m] = 1
            host[3, r0 : r0 + c] = row.slot * r
            host[4, b] = r0 + m - 1
            self.hidden[r0 : r0 + m].copy_(row.hidden)
        self._packed[:, :n].copy_(host[:, :n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = recorded_event(self.device)

    def _write_live(self, slots: list[int], starts: list[int], size: int) -> None:
        """The host's part of a cycle behind a verify step: every row of a live request active (the
        device keeps its accepted rows), its positions and ring base; padded requests inactive."""
        c = self.rows_per_request
        n = size * c
        if self._copied is not None:
            self._copied.synchronize()
        pad = n - len(slots) * c
        positions = [start + i for start in starts for i in range(c)] + [0] * pad
        active = [1] * (n - pad) + [0] * pad
        r = self.cache.rows_per_seq
        bases = [slot * r for slot in slots for _ in range(c)] + [self.cache.pools.scratch_swa_row] * pad
        self._host[:, :n] = torch.tensor([[0] * n, positions, active, bases, [0] * n])
        self._packed[:, :n].copy_(self._host[:, :n], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = recorded_event(self.device)

    def _after_verify(self, size: int, verified: VerifiedRows) -> torch.Tensor:
        """The verdict of each request's drafts from the verify step's rows, then the cycle over its
        accepted rows -> drafts [size, k] int64 (device ops only)."""
        c, n = self.rows_per_request, size * self.rows_per_request
        m = min(n, verified.streams.shape[0])  # rows past the verify step's size belong to padded requests
        given = torch.zeros(n, dtype=torch.long, device=self.device)
        best = torch.zeros(n, dtype=torch.long, device=self.device)
        given[:m] = verified.token_ids[:m]
        best[:m] = verified.argmax[:m]
        grid_given, grid_best = given.view(size, c), best.view(size, c)
        accepted = (grid_given[:, 1:] == grid_best[:, :-1]).long().cumprod(dim=1).sum(dim=1)  # [size]
        within = torch.arange(c, device=self.device)[None, :] <= accepted[:, None]  # [size, C]
        live = self._packed[2, :n].bool() & within.reshape(n)
        self.hidden[:m].copy_(verified.streams[:m])
        last = torch.arange(size, device=self.device) * c + accepted
        return self._cycle(size, torch.where(live, best, 0), torch.where(live, self._packed[1, :n], 0), live,
                           self._packed[3, :n], last)

    def _step(self, size: int) -> torch.Tensor:
        """The whole cycle over `size` requests -> drafts [size, k] int64 (rows of padded requests are
        garbage)."""
        n = size * self.rows_per_request
        ids, positions, active, base = (self._packed[i, :n] for i in range(4))
        return self._cycle(size, ids, positions, active.bool(), base, self._packed[4, :size])

    def _cycle(self, size: int, ids: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
               base: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The catch-up over the C rows of each of `size` requests (ids, positions, base: [size * C]
        int64; live [size * C] bool; last [size] each request's last active row), then the chain."""
        c, k = self.rows_per_request, self.num_drafts
        n = size * c
        index = self.cache.fixed_index(base, positions, live)
        logits, streams = self.block.run(self.target, self.hidden[:n], ids, index, positions, self.cache,
                                         last, kernels=True, head=self.head)
        streams = streams[last]  # [size, n, D]
        request_live = live.view(size, c)[:, 0]
        request_base = base.view(size, c)[:, 0]
        position = positions[last]
        drafts = [logits.argmax(dim=-1)]
        for _ in range(1, k):
            position = position + 1
            index = self.cache.fixed_index(request_base, position, request_live)
            logits, streams = self.block.run(self.target, streams, drafts[-1], index, position, self.cache,
                                             kernels=True, head=self.head)
            drafts.append(logits.argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def _capture(self, key: tuple[int, ...], step: Callable[[], torch.Tensor]
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiles the kernels) and capture `step` over key[0] requests with every row
        inactive, then restore the rows."""
        n = key[0] * self.rows_per_request
        saved = self._packed[2, :n].clone()
        self._packed[2, :n] = 0
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            drafts = step()
        self._packed[2, :n] = saved
        self._graphs[key] = (graph, drafts)
        return graph, drafts


def greedy_drafts(drafts: torch.Tensor, counts: list[int], num_tokens: list[int]) -> list[Drafts | None]:
    """drafts [B, k] int64 (device) -> each request's `Drafts`: its first counts[b] tokens, copied to the
    host behind the cycle (the graph's output is rewritten by the next replay) and read on first use
    (`late_tokens.py`), their distributions one-hot (a greedy draft's, `Drafts.probs` None); None
    where counts[b] is 0."""
    read = LateRead.start(drafts)
    return [Drafts(LateTokenIds(read, b, n), None, num_tokens[b]) if n else None
            for b, n in enumerate(counts)]
