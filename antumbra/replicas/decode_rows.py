"""The rows of a fixed-shape decode step: one per new token, a verify chunk's positions flattened.

A plain decode chunk is one row. A speculative verify chunk (a request's last known token and its k
drafts, positions c .. c + k) becomes k + 1 consecutive rows of one sequence that share its block
table: the fixed-shape step computes each row as a decode at its own position, and since every layer
stores all rows' keys and compression state before any row closes a window or attends, each row
reads the drafts before it as a prefill chunk's token would (`model/fast_decode.py`).

Invariants a verify step relies on (`verify_eligible`): no HiSparse pools (one hot buffer per
request, which two rows of it would page into at once), no row that wants every position's logits or
routing, no replayed prefix past the chunk's start, and every token known on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import EngineConfig
from antumbra.kernels.decode_index import sources

from .request import Request
from .step_io import PENDING, ScheduledChunk


@dataclass(frozen=True)
class DecodeRow:
    request: Request
    position: int
    token_id: int  # PENDING: the previous overlapped launch's draw, still on the device


def token_at(request: Request, position: int) -> int:
    prompt = request.prompt_token_ids
    return prompt[position] if position < len(prompt) else request.output_token_ids[position - len(prompt)]


def plain_rows(chunks: list[ScheduledChunk]) -> list[DecodeRow]:
    """One row per one-token chunk."""
    return [DecodeRow(c.request, c.start, token_at(c.request, c.start)) for c in chunks]


def verify_rows(chunks: list[ScheduledChunk]) -> list[DecodeRow]:
    """One row per token of every chunk, in chunk order (a verify chunk's drafts after its known token)."""
    return [
        DecodeRow(c.request, c.start + i, token)
        for c in chunks
        for i, token in enumerate(c.token_ids())
    ]


def takes_chunk(chunk: ScheduledChunk, hisparse: bool) -> bool:
    """Whether the fixed-shape step can compute the chunk as one row: one token, no verify, past any
    replayed prefix, nothing wanted of it but its logits row (with HiSparse, its request holds a hot
    buffer). A chunk that does not sample (a prompt token, which batch-invariant mode runs here too:
    `runner.py`) leaves its row unread."""
    return (
        chunk.num_new_tokens == 1
        and not chunk.verify
        and not chunk.request.computes_every_token
        and (chunk.request.kv.hot_buffer >= 0) == hisparse
        and chunk.start + 1 > chunk.request.kv.replay_until
    )


def decode_eligible(chunks: list[ScheduledChunk], max_rows: int, hisparse: bool) -> bool:
    """Whether a plain step runs as one fixed-shape step over `plain_rows`: every chunk a decode that
    samples and `takes_chunk`."""
    if not chunks or len(chunks) > max_rows:
        return False
    return all(c.samples and takes_chunk(c, hisparse) for c in chunks)


def verify_eligible(chunks: list[ScheduledChunk], max_rows: int, hisparse: bool) -> bool:
    """Whether a speculating step runs as one fixed-shape step over `verify_rows` (each chunk a verify
    chunk or a one-token decode that samples)."""
    return _rows_fit(chunks, max_rows, hisparse) and all(
        (c.verify or (c.num_new_tokens == 1 and c.samples)) and _rows_computable(c) for c in chunks
    )


def prompt_rows_eligible(chunks: list[ScheduledChunk], max_rows: int, hisparse: bool,
                         pending: bool = False) -> bool:
    """Whether a step of decodes and prompt chunks runs as one fixed-shape step over `verify_rows`,
    each prompt token a row, under a verify step's rules (`_rows_fit`, `_rows_computable`); one chunk
    has more than one token (a step of one-token chunks is a decode step). `pending`: a one-token
    chunk's token may still be on the device (an overlapped launch takes it there, `overlap.py`)."""
    return (_rows_fit(chunks, max_rows, hisparse) and any(c.num_new_tokens > 1 for c in chunks)
            and all(not c.verify and _rows_computable(c, pending and c.num_new_tokens == 1) for c in chunks))


def sampling_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The row of each sampling chunk's token in `verify_rows(chunks)`: its chunk's last row."""
    at, end = [], 0
    for chunk in chunks:
        end += chunk.num_new_tokens
        if chunk.samples:
            at.append(end - 1)
    return at


def _rows_fit(chunks: list[ScheduledChunk], max_rows: int, hisparse: bool) -> bool:
    """Every token of the step a row: no HiSparse pools (one hot buffer per request, which two rows
    of it would page into at once), and no more rows than the largest graph holds."""
    return not hisparse and bool(chunks) and sum(c.num_new_tokens for c in chunks) <= max_rows


def _rows_computable(chunk: ScheduledChunk, pending: bool = False) -> bool:
    """Whether each token of the chunk can be a row: nothing wanted of it but its logits row, past
    any replayed prefix, every token known on the host (unless `pending`; drafts are never pending,
    and are not read here: they may still be on their way, `late_tokens.py`)."""
    known = chunk.request.token_ids_range(chunk.start, chunk.stop - len(chunk.draft_ids))
    return (not chunk.request.computes_every_token and chunk.start >= chunk.request.kv.replay_until
            and (pending or PENDING not in known))


def check_written_rows(rows: list[DecodeRow], written: list[int], pools: KVPools) -> None:
    """written[r]: the SWA row the step wrote row r's key to (the step's probe) -> raises unless it is
    the row the host's page tables give for that position."""
    page = pools.layout.page_size
    table = pools.swa_page_table_host()
    for row, got in zip(rows, written, strict=True):
        vpage = row.request.kv.vpages[row.position // page]
        want = table[vpage] * page + row.position % page
        if got != want:
            raise RuntimeError(
                f"fast decode wrote {row.request.request_id} position {row.position} to SWA row {got}, "
                f"its page table says {want}"
            )


# Between the largest configured graph size and the most rows a prompt rows step holds, each graph
# is this much larger than the one before (rounded up to ROWS_GRAPH_ALIGN rows): a step pads to the
# next size, so no step computes more than half again its own rows, and the graphs stay few.
ROWS_GRAPH_GROWTH = 1.5
ROWS_GRAPH_ALIGN = 8


def graph_batch_sizes(config: EngineConfig, prefill_rows: int = 0) -> tuple[int, ...]:
    """Row counts the fixed-shape step is built for: the configured graph sizes up to the most rows a
    step holds (`max_num_seqs`; with speculation, k + 1 rows for each request that may speculate;
    plus `prefill_rows` prompt rows, `prompt_rows_eligible`), and with prompt rows sizes growing by
    `ROWS_GRAPH_GROWTH` from the largest configured one up to that most itself."""
    max_rows = config.scheduler.max_num_seqs
    spec = config.speculative
    if spec.tokens:
        max_rows = max(max_rows, min(max_rows, spec.max_batch) * (spec.tokens + 1))
    max_rows += prefill_rows
    sizes = tuple(b for b in config.fast.cuda_graph_batch_sizes if b <= max_rows)
    if prefill_rows:
        size = max(sizes, default=1)
        while size < max_rows:
            grown = -(-int(size * ROWS_GRAPH_GROWTH) // ROWS_GRAPH_ALIGN) * ROWS_GRAPH_ALIGN
            size = min(max(grown, size + 1), max_rows)
            sizes = (*sizes, size)
    return sizes


def take_sources(packed: torch.Tensor, drawn: torch.Tensor) -> None:
    """packed [4 or 5, B] int64: row 0 := drawn[row 3] where row 3 >= 0 (a token the last overlapped
    launch drew, still on the device). One launch on CUDA, the reference's chain elsewhere."""
    (sources.take_sources if packed.is_cuda else sources.take_sources_reference)(packed, drawn)
