"""Turns scheduled chunks into the model's batch description and runs one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from antumbra.cachestore.pools import KVPools

from .decode_graphs import DecodeGraphs
from .model.forward_batch import ForwardBatch
from .model.model import DeepseekV4
from .sampler import SamplingRows
from .scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepResult:
    sample_logits: torch.Tensor  # [S, V] float32: row i for the i-th chunk that samples
    sampled: torch.Tensor | None  # [S] int64 tokens a decode graph drew itself (plain rows), else None
    prompt_logits: dict[str, torch.Tensor]  # request_id -> [n, V] logits of every token of its chunk (CPU)
    routed_experts: dict[str, torch.Tensor]  # request_id -> [n, L, k] routed expert ids of its chunk


class Runner:
    def __init__(
        self, model: DeepseekV4, pools: KVPools, device: torch.device, fast: DecodeGraphs | None = None
    ) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        self.fast = fast

    def build_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """-> (batch, per chunk: (first token row, first logits row))."""
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
            if chunk.request.want_prompt_logits:
                logits_rows.extend(range(row0, row0 + chunk.num_new_tokens))
            elif chunk.samples:
                logits_rows.append(row0 + chunk.num_new_tokens - 1)
        width = max(len(c.request.vpages) for c in chunks)
        tables = torch.full((len(chunks), width), -1, dtype=torch.long)
        for b, chunk in enumerate(chunks):
            tables[b, : len(chunk.request.vpages)] = torch.tensor(chunk.request.vpages, dtype=torch.long)

        def dev(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        batch = ForwardBatch(
            input_ids=dev(ids),
            positions=dev(positions),
            req_index=dev(req_index),
            block_tables=tables.to(self.device, non_blocking=True),
            logits_indices=dev(logits_rows),
            spans=tuple((row0, row0 + c.num_new_tokens) for (row0, _), c in zip(spans, chunks, strict=True)),
            replay_until=dev([c.request.replay_until for c in chunks]),
            hot_buffers=tuple(c.request.hot_buffer for c in chunks),
        )
        return batch, spans

    def run(self, chunks: list[ScheduledChunk], rows: SamplingRows, record_experts: bool = False) -> StepResult:
        """`rows`: the sampling settings of the chunks that sample, in chunk order."""
        if self.fast is not None and not record_experts and self.fast.eligible(chunks):
            logits, sampled = self.fast.run(chunks, rows)
            return StepResult(logits, sampled, {}, {})
        batch, spans = self.build_batch(chunks)
        out = self.model(batch, self.pools)
        logits = out.logits
        sample_rows: list[int] = []
        prompt, experts = {}, {}
        for chunk, (row0, logit0) in zip(chunks, spans, strict=True):
            rid = chunk.request.request_id
            if chunk.request.want_prompt_logits:
                prompt[rid] = logits[logit0 : logit0 + chunk.num_new_tokens].cpu()
                if chunk.samples:
                    sample_rows.append(logit0 + chunk.num_new_tokens - 1)
            elif chunk.samples:
                sample_rows.append(logit0)
            if record_experts:
                experts[rid] = out.routed_experts[row0 : row0 + chunk.num_new_tokens].cpu()
        if sample_rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(sample_rows, dtype=torch.long).to(logits.device)]
        return StepResult(logits, None, prompt, experts)
