"""Pure-decode steps through the fixed-shape path, replayed from CUDA graphs on GPUs.

Which steps qualify: `decode_rows.py` (with HiSparse the step pages each request's CSA rows into its
hot buffer on the device, `model/fast_decode.py`). A batch is padded up to the smallest configured graph
size; padded rows are inactive and only touch scratch rows. Graphs are captured at engine start (or on
a batch size's first use) with every row inactive (so warm-up and capture write nothing live), then
replayed with the real rows: the host only copies token ids, positions, block tables and the rows'
sampling keys into the static buffers.

Each graph ends with the sampler's Gumbel race over its logits (`graph_race.py`: with the engine's
penalty state, the race over its slots, which also counts the drawn tokens), so a step whose rows need
no top-k / top-p cut (`GraphRace.draws`) gets its tokens from the replay itself; other steps sample the
graph's logits afterwards. `run_verify` runs a speculating step, a verify chunk's k + 1 positions as
rows of one sequence, and keeps the last layer's streams the MTP drafter reads; it runs a step of
decodes beside short prompt chunks the same way, each prompt token a row.

`launch` is the overlapped form (`overlap.py`): a row's token id may be the one the previous
launch drew, still on the device (`PENDING` on the host); the graph's first op takes it from
the race's output. The drawn tokens are copied to pinned host memory behind an event, so the
host schedules the next step while this one runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from antumbra.cachestore.pools import KVPools
from antumbra.config import EngineConfig

from . import decode_rows
from .device_events import recorded_event
from .graph_race import GraphRace
from .host_tables import HostTables
from .launched import Launched
from .masked_draw import MaskedDraw
from .model.fast_decode import DecodeInputs, DecodeShape, decode_step
from .model.model import DeepseekV4
from .penalty_state import PenaltyState
from .plan import DecodePath, ExecutionPlan, SamplerImpl, invariant_batch_size
from .sampler import SamplingRows
from .step_io import PENDING, ScheduledChunk
from .step_result import VerifiedRows


def decode_graphs_for(
    model: DeepseekV4, pools: KVPools, max_model_len: int, config: EngineConfig, plan: ExecutionPlan,
    penalties: PenaltyState | None = None,
) -> DecodeGraphs | None:
    """The plan's fixed-shape decode path, or None when decodes take the general step;
    `penalties`: the engine's penalty state, whose rows the graphs' race then draws and counts."""
    if plan.decode is DecodePath.GENERAL:
        return None
    sizes = decode_rows.graph_batch_sizes(config, plan.prefill_rows) or (config.scheduler.max_num_seqs,)
    if plan.deterministic:
        sizes = (invariant_batch_size(config),)
    graphs = DecodeGraphs(
        model, pools, max_model_len, sizes,
        use_graphs=plan.decode is DecodePath.GRAPHS, overlap_indexer=plan.overlap_indexer,
        penalties=penalties, race_kernel=plan.sampler is SamplerImpl.TRITON,
    )
    if plan.capture_at_start:
        graphs.capture_all()
    return graphs


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekV4,
        pools: KVPools,
        max_model_len: int,
        batch_sizes: tuple[int, ...],
        use_graphs: bool,
        overlap_indexer: bool = False,
        penalties: PenaltyState | None = None,
        race_kernel: bool = True,
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = pools.device
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.use_graphs = use_graphs
        self._side = (
            torch.cuda.Stream(self.device) if overlap_indexer and self.device.type == "cuda" else None
        )
        page = pools.layout.page_size
        self._shapes = {b: DecodeShape.for_model(model, b, max_model_len, page) for b in self.batch_sizes}
        biggest = self._shapes[self.batch_sizes[-1]]
        pinned = self.device.type == "cuda"
        # Rows 0-2 are DecodeInputs.packed (token ids, positions, active); row 3 the previous
        # launch's race row whose draw is the token id (-1: the id in row 0 is the token); row 4
        # the first row of each row's HiSparse hot buffer (DecodeInputs.hot_base; 0 without one).
        self._packed = torch.zeros(5, biggest.batch_size, dtype=torch.long, device=self.device)
        self._host_packed = torch.zeros(5, biggest.batch_size, dtype=torch.long, pin_memory=pinned)
        tables = DecodeInputs.empty(biggest, self.device).block_tables
        hot_base = self._packed[4] if pools.hot is not None else None
        self.inputs = DecodeInputs(self._packed[:3], tables, hot_base)
        self._host = DecodeInputs(self._host_packed[:3], DecodeInputs.empty(biggest, torch.device("cpu"),
                                                                            pin_memory=pinned).block_tables)
        self._copied: torch.cuda.Event | None = None  # the last host-to-device input copy
        self._drawn = [torch.zeros(biggest.batch_size, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._flip = 0
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._streams: dict[int, torch.Tensor] = {}  # size -> its graph's last-layer streams [size, n, D]
        self.verified: VerifiedRows | None = None  # the last `run_verify` step's rows, whole graph size
        # Set `validate` to check, after every step, that each row's new token went to the SWA
        # row the host's page tables give (it synchronises: for tests and benchmarks).
        self.validate = False
        self._tables = HostTables(self._host.block_tables)
        self._probe = torch.zeros(biggest.batch_size, dtype=torch.long, device=self.device)
        self._graph_pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.num_steps = 0
        # The race's static inputs and its drawn tokens inside the graphs.
        self.race = GraphRace(biggest.batch_size, model.config.vocab_size, self.device, penalties, use_graphs,
                              race_kernel)
        self._tokens = self.race.tokens
        self._masked = MaskedDraw(self.race, biggest.batch_size, self.device, self._graph_pool)
        # Rank 0 of a parallel replica (replicas/parallel/gang.py): called with (padded size, rows)
        # once a step's inputs are written, and before `capture_all`, to send them to the ranks.
        self.before_step: Callable[[int, int], None] | None = None
        self.before_capture_all: Callable[[], None] | None = None

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def eligible(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step is a decode step this path runs whole (`decode_rows.decode_eligible`)."""
        return decode_rows.decode_eligible(chunks, self.max_batch_size, self.pools.hot is not None)

    def takes(self, chunk: ScheduledChunk) -> bool:
        """Whether this step can compute the chunk (`decode_rows.takes_chunk`)."""
        return decode_rows.takes_chunk(chunk, self.pools.hot is not None)

    def verifies(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a speculating step runs here (`decode_rows.verify_eligible`)."""
        return decode_rows.verify_eligible(chunks, self.max_batch_size, self.pools.hot is not None)

    def takes_prompt_rows(self, chunks: list[ScheduledChunk], pending: bool = False) -> bool:
        """Whether a step of decodes and prompt chunks runs here, every token a row
        (`decode_rows.prompt_rows_eligible`; `run_verify` runs it, `launch` with `at` overlapped)."""
        hisparse = self.pools.hot is not None
        return decode_rows.prompt_rows_eligible(chunks, self.max_batch_size, hisparse, pending)

    def run_verify(self, chunks: list[ScheduledChunk], greedy: bool = False,
                   draw_at: tuple[SamplingRows, list[int]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A step of verify or prompt chunks, every token a row (`decode_rows.verify_rows`) ->
        (logits [R, V] float32, last-layer streams [R, n, D], the race's draws [R] int64 or None),
        row r for the r-th token in chunk order. The race draws each row's argmax with `greedy`, and
        with `draw_at` (rows without slots or min_p, their positions) those rows' tokens at those
        positions (`GraphRace.stage_at`). Views of the step's outputs, valid until the next step. Its
        race counts nothing (verify tokens are decided by the rejection rule after it)."""
        rows = decode_rows.verify_rows(chunks)
        count = len(rows)
        size = self._prepare(rows)
        if greedy:
            self.race.stage(None, count, final=False)  # zero keys: each row's argmax
        elif draw_at is not None:
            self.race.stage_at(draw_at[0], draw_at[1], count)
        elif self.race.penalties is not None:
            self.race.blank()  # no penalty slot counts this step's draws
        drawn = greedy or draw_at is not None
        captured = self.graph_for(count)
        if captured is None:
            logits, streams = self._eager_streams(size)
            if drawn:
                self.race.race(logits, size)
        else:
            captured[0].replay()
            logits, streams = captured[1], self._streams[size]
        self.verified = VerifiedRows(self._packed[0, :size], self._tokens[:size], streams)
        if self.validate:
            decode_rows.check_written_rows(rows, self._probe[:count].tolist(), self.pools)
        return logits[:count], streams[:count], self._tokens[:count] if drawn else None

    def run(self, chunks: list[ScheduledChunk], rows: SamplingRows | None) -> tuple[Tensor, Tensor | None]:
        """-> (logits [len(chunks), V] float32, row i for chunks[i]; the graph's own draws [len(chunks)]
        int64 when its race draws the rows and a graph ran, else None). A step with a structured-output
        row is drawn again under its masks: its race counts nothing; so does a step without `rows`
        (a mixed step's decode rows, which the caller samples, `runner.py`)."""
        count, tokens = len(chunks), None
        size = self._prepare(decode_rows.plain_rows(chunks))
        captured = self.graph_for(count)
        if captured is None:
            logits = self._eager_streams(size)[0]
        else:
            final = (rows is not None and self.race.draws(rows)
                     and all(c.request.grammar is None for c in chunks))
            self._copy_rows(rows, count, final)
            graph, logits = captured
            graph.replay()
            tokens = self._tokens[:count] if final else None
        if self.validate:
            rows_written = decode_rows.plain_rows(chunks)
            decode_rows.check_written_rows(rows_written, self._probe[:count].tolist(), self.pools)
        return logits[:count], tokens

    def _prepare(self, rows: list[decode_rows.DecodeRow]) -> int:
        """Write a step's inputs for the parallel ranks too -> the graph size it runs at."""
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, len(rows))]
        self._write_inputs(rows, size, None)
        if self.before_step is not None:
            self.before_step(size, len(rows))
        self.num_steps += 1
        return size

    def launch(
        self, chunks: list[ScheduledChunk], rows: SamplingRows, drawn_at: Mapping[int, int],
        masked: bool = False, at: list[int] | None = None,
    ) -> Launched:
        """Start a step the race draws without waiting for it. A row whose token is `PENDING` takes
        the previous launch's draw at row drawn_at[id(its request)]. -> its draws [rows], once copied.
        `masked`: the rows draw under allowed-token masks given later (`Launched.draw`), so the
        host computes them while this forward runs. `at`: a step of prompt rows (`verify_rows`), the
        sampling rows drawn at those rows (`GraphRace.stage_at`)."""
        if not (self.race.draws(rows) if at is None else self.race.draws_at(rows) and not masked):
            raise ValueError("an overlapped step samples in the graph: its race must draw every row")
        written = decode_rows.plain_rows(chunks) if at is None else decode_rows.verify_rows(chunks)
        count = len(written)
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, count)]
        sources = [drawn_at.get(id(r.request), -1) if r.token_id == PENDING else -1 for r in written]
        self._write_inputs(written, size, sources)
        self.num_steps += 1
        self._copy_rows(rows, count, final=not masked, at=at)
        captured = self.graph_for(count)
        if captured is None:
            logits = self._eager_streams(size)[0]
            if not masked:
                self.race.race(logits, size)
        else:
            captured[0].replay()
            logits = captured[1]
        host = self._drawn[self._flip][:count]
        self._flip ^= 1
        if self.validate:
            decode_rows.check_written_rows(written, self._probe[:count].tolist(), self.pools)
        if masked:
            graphed = captured is not None

            def draw(allowed: torch.Tensor | None) -> torch.cuda.Event | None:
                return self._draw_masked(logits, count, allowed, host, graphed)

            return Launched(host, None, draw, self.device)
        return Launched(host, self._copy_out(host))

    def _draw_masked(self, logits: torch.Tensor, count: int, allowed: torch.Tensor | None, host: torch.Tensor,
                     graphed: bool) -> torch.cuda.Event | None:
        """Draw the launched rows under their masks (into the draws the next launch takes its
        pending tokens from, `masked_draw.py`) and copy them out."""
        self._masked.draw(logits, count, allowed, graphed)
        return self._copy_out(host)

    def _copy_out(self, host: torch.Tensor) -> torch.cuda.Event | None:
        host.copy_(self._tokens[: host.shape[0]], non_blocking=True)
        if self.device.type != "cuda":
            return None
        return recorded_event(self.device)

    def host_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last written step's inputs: ([5, size] ids / positions / active / sources / hot-buffer
        rows, block tables [size, P]) int64 on the CPU, copies."""
        return self._host_packed[:, :size].clone(), self._host.block_tables[:size].clone()

    def replay_inputs(self, size: int, count: int, packed: torch.Tensor, tables: torch.Tensor) -> None:
        """Another rank of a parallel replica: run rank 0's step from its `host_inputs` (the same
        graph, or the same eager step, as rank 0 runs; its logits are not read)."""
        self._host_packed[:, :size] = packed
        self._host.block_tables[:size] = tables
        self._packed.copy_(self._host_packed, non_blocking=True)
        self.inputs.block_tables[:size].copy_(self._host.block_tables[:size], non_blocking=True)
        self.num_steps += 1
        captured = self.graph_for(count)
        if captured is None:
            self._eager_streams(size)[0]
        else:
            captured[0].replay()

    def _copy_rows(self, rows: SamplingRows | None, count: int, final: bool, at: list[int] | None = None
                   ) -> None:
        """The rows' sampling keys, slack and slots to the race's buffer (`GraphRace.stage`, or
        `stage_at` the rows `at`), after the step's other inputs (so `_copied`, which the next step
        waits for, covers this copy)."""
        if at is not None and rows is not None:
            self.race.stage_at(rows, at, count)
        else:
            self.race.stage(rows, count, final)
        if self.device.type == "cuda":
            self._copied = recorded_event(self.device)

    def _eager_streams(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        decode_rows.take_sources(self._packed[:, :size], self._tokens)
        return decode_step(self.model, self.inputs.head(size), self.pools, self._shapes[size],
                                   self._probe[:size], self._side)

    def _write_inputs(self, rows: list[decode_rows.DecodeRow], size: int, sources: list[int] | None) -> None:
        page = self.pools.layout.page_size
        ids, positions, bases = [0] * size, [0] * size, [0] * size
        hot = self.pools.hot
        if self._copied is not None:
            # The last step's copy may still wait behind the graph before it (overlapped steps):
            # the pinned buffers are rewritten only once it has read them.
            self._copied.synchronize()
        for b, row in enumerate(rows):
            request = row.request
            vpage = request.kv.vpages[row.position // page]
            if not self.pools.has_swa(vpage):
                # The device would write a scratch row; fail here with the facts instead.
                raise RuntimeError(
                    f"decode of {request.request_id} at position {row.position}: virtual page {vpage} "
                    f"has no SWA page (shared pages {len(request.kv.shared_path)}, "
                    f"released {request.kv.swa_released_pages}, replay until {request.kv.replay_until})"
                )
            ids[b] = row.token_id
            if ids[b] == PENDING and (sources is None or sources[b] < 0):
                raise RuntimeError(
                    f"decode of {request.request_id}: its token at {row.position} is still on the device"
                )
            positions[b] = row.position
            if hot is not None:
                bases[b] = hot.base(request.kv.hot_buffer)
                hot.mark_overwritten(request.kv.hot_buffer)  # the step rewrites its buffer's rows
        self._tables.write(rows, size)
        src = (list(sources) if sources is not None else [-1] * len(rows)) + [-1] * (size - len(rows))
        active = [1] * len(rows) + [0] * (size - len(rows))
        self._host_packed[:, :size] = torch.tensor([ids, positions, active, src, bases])
        self._packed.copy_(self._host_packed, non_blocking=True)
        self._tables.flush(self.inputs.block_tables)
        if self.device.type == "cuda":
            self._copied = recorded_event(self.device)

    @property
    def overlap_indexer(self) -> bool:
        return self._side is not None

    def set_overlap_indexer(self, enabled: bool) -> None:
        """Run the CSA indexers on a second stream (or not); drops the captured graphs."""
        self._side = torch.cuda.Stream(self.device) if enabled and self.device.type == "cuda" else None
        self._graphs.clear()
        self._streams.clear()
        if self._graph_pool is not None:
            # A new pool: the old one may still hold blocks a caller keeps (a graph's logits), and
            # capturing into a pool whose graphs are all gone trips the allocator's use-count check.
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._masked = MaskedDraw(self.race, self.max_batch_size, self.device, self._graph_pool)

    def capture_all(self) -> None:
        """Capture every configured batch size now (at start-up) rather than on first use, where a
        capture would stall that step by the warm-up and capture time."""
        if self.before_capture_all is not None:
            self.before_capture_all()
        for size in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool
            self.graph_for(size)

    def graph_for(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The captured graph (and its logits) that serves `rows` rows, capturing it if needed."""
        if not self.use_graphs:
            return None
        if self.race.stale():  # the slot tables moved: the graphs read the old ones
            self.set_overlap_indexer(self.overlap_indexer)  # drops them (and their pool)
        size = self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows)]
        return self._graphs.get(size) or self._capture(size)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiles the kernels) and capture with every row inactive, then restore the rows."""
        inputs, shape = self.inputs.head(size), self._shapes[size]
        # The warm-up runs overwrite the ids (sources taken) and the draws a pending launch reads.
        saved, ids, drawn = inputs.active.clone(), inputs.input_ids.clone(), self._tokens.clone()
        staged = self.race.blank()  # the warm-up runs count nothing
        inputs.active.fill_(0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                decode_rows.take_sources(self._packed[:, :size], self._tokens)
                logits, _ = decode_step(self.model, inputs, self.pools, shape, side=self._side)
                self.race.race(logits, size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of a serving process may touch CUDA while this one captures.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            decode_rows.take_sources(self._packed[:, :size], self._tokens)
            logits, streams = decode_step(self.model, inputs, self.pools, shape, self._probe[:size],
                                                  self._side)
            self.race.race(logits, size)
        self.race.restore(staged)
        inputs.active.copy_(saved)
        inputs.input_ids.copy_(ids)
        self._tokens.copy_(drawn)
        self._graphs[size] = (graph, logits)
        self._streams[size] = streams
        return graph, logits
