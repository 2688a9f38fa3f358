"""Turns scheduled chunks into the model's batch description and runs one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools
from antumbra.config import ModelConfig

from .decode_graphs import DecodeGraphs
from .model.forward_batch import ForwardBatch, to_device
from .model.model import DeepseekV4
from .sampler import SamplingRows
from .scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepResult:
    sample_logits: torch.Tensor  # [S, V] float32: row i for the i-th chunk that samples
    sampled: torch.Tensor | None  # [S] int64 tokens a decode graph drew (and counted) itself, else None
    prompt_logits: dict[str, torch.Tensor]  # request_id -> [n, V] logits of every token of its chunk (CPU)
    routed_experts: dict[str, torch.Tensor]  # request_id -> [n, L, k] int16 routed experts of its chunk (CPU)
    prompt_hidden: dict[str, torch.Tensor] | None = None  # request_id -> [n, D] float32 hidden states (CPU)


class Runner:
    """`separate`: each chunk runs as a forward of its own (batch-invariant mode, where every chunk
    is one token): no chunk's arithmetic then depends on what else is in the step."""

    def __init__(
        self, model: DeepseekV4, pools: KVPools, device: torch.device, fast: DecodeGraphs | None = None,
        separate: bool = False,
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        self.fast = fast
        self.separate = separate

    def build_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """-> (batch, per chunk: (first token row, first logits row)).

        Every index list is built on the host and travels in one asynchronous copy (`to_device`:
        pinned memory on CUDA), so building a step never waits for the step before it."""
        ids: list[int] = []
        positions: list[int] = []
        req_index: list[int] = []
        logits_rows: list[int] = []
        spans = []
        for b, chunk in enumerate(chunks):
            row0 = len(ids)
            ids.extend(chunk.request.token_ids_range(chunk.start, chunk.stop))
            positions.extend(range(chunk.start, chunk.stop))
            req_index.extend([b] * chunk.num_new_tokens)
            spans.append((row0, len(logits_rows)))
            if _wants_rows(chunk):
                logits_rows.extend(range(row0, row0 + chunk.num_new_tokens))
            elif chunk.samples:
                logits_rows.append(row0 + chunk.num_new_tokens - 1)
        vpages = tuple(tuple(c.request.vpages) for c in chunks)
        width = max(len(v) for v in vpages)
        tables = [page for v in vpages for page in (*v, *([-1] * (width - len(v))))]  # [B * P]
        lists = [ids, positions, req_index, logits_rows, tables]
        packed = to_device([x for values in lists for x in values], self.device)
        input_ids, pos, req, logits_indices, block_tables = packed.split([len(v) for v in lists])

        replay = None
        if any(c.request.replay_experts is not None for c in chunks):
            replay = to_device(torch.cat([_replay_rows(c, self.model.config) for c in chunks]), self.device)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=pos,
            req_index=req,
            block_tables=block_tables.view(len(chunks), width),
            logits_indices=logits_indices,
            spans=tuple((row0, row0 + c.num_new_tokens) for (row0, _), c in zip(spans, chunks, strict=True)),
            starts=tuple(c.start for c in chunks),
            vpages=vpages,
            replay_until=tuple(c.request.replay_until for c in chunks),
            hot_buffers=tuple(c.request.hot_buffer for c in chunks),
            routed_experts=replay,
        )
        return batch, spans

    def run(self, chunks: list[ScheduledChunk], rows: SamplingRows) -> StepResult:
        """`rows`: the sampling settings of the chunks that sample, in chunk order."""
        if self.fast is not None and self.fast.eligible(chunks):
            logits, sampled = self.fast.run(chunks, rows)
            return StepResult(logits, sampled, {}, {})
        if self.separate and len(chunks) > 1:
            return _merged([self._forward([chunk]) for chunk in chunks])
        return self._forward(chunks)

    def _forward(self, chunks: list[ScheduledChunk]) -> StepResult:
        batch, spans = self.build_batch(chunks)
        out = self.model(batch, self.pools)
        logits = out.logits
        sample_rows: list[int] = []
        prompt, experts, hidden = {}, {}, {}
        for chunk, (row0, logit0) in zip(chunks, spans, strict=True):
            request, rid, n = chunk.request, chunk.request.request_id, chunk.num_new_tokens
            if _wants_rows(chunk):
                if request.want_prompt_logits:
                    prompt[rid] = logits[logit0 : logit0 + n].cpu()
                if request.want_prompt_hidden:
                    hidden[rid] = out.hidden[logit0 : logit0 + n].float().cpu()
                if chunk.samples:
                    sample_rows.append(logit0 + n - 1)
            elif chunk.samples:
                sample_rows.append(logit0)
            if request.params.return_routed_experts:
                experts[rid] = out.routed_experts[row0 : row0 + n].to(torch.int16).cpu()
        if sample_rows != list(range(logits.shape[0])):
            logits = logits[to_device(sample_rows, logits.device)]
        return StepResult(logits, None, prompt, experts, hidden)


def _merged(results: list[StepResult]) -> StepResult:
    """Step results of consecutive chunk groups as one (sample rows in chunk order)."""
    return StepResult(
        torch.cat([r.sample_logits for r in results]),
        None,
        {k: v for r in results for k, v in r.prompt_logits.items()},
        {k: v for r in results for k, v in r.routed_experts.items()},
        {k: v for r in results for k, v in (r.prompt_hidden or {}).items()},
    )


def _wants_rows(chunk: ScheduledChunk) -> bool:
    """Whether every token of the chunk needs its logits row (prompt logits or hidden states)."""
    return chunk.request.want_prompt_logits or chunk.request.want_prompt_hidden


def _replay_rows(chunk: ScheduledChunk, cfg: ModelConfig) -> torch.Tensor:
    """[n, L, k] int64 experts the chunk's tokens must use: the request's replayed routing where it
    covers the positions, -1 (choose freely) past its end or without one."""
    out = torch.full((chunk.num_new_tokens, cfg.num_layers, cfg.num_experts_per_tok), -1, dtype=torch.long)
    given = chunk.request.replay_experts
    if given is not None:
        stop = min(chunk.stop, given.shape[0])
        if stop > chunk.start:
            out[: stop - chunk.start] = given[chunk.start : stop].long()
    return out
