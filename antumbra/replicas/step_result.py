"""What the runner's forward gives for a step (`StepResult`), before its tokens are drawn."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifiedRows:
    """A fixed-shape step of rows as the device holds it (`DecodeGraphs.run_verify`), padded to its
    graph size G: what a draft cycle launched behind it reads without the host waiting."""

    token_ids: torch.Tensor  # [G] int64 each row's input token
    argmax: torch.Tensor  # [G] int64 the race's argmax at each row (greedy steps)
    streams: torch.Tensor  # [G, n, D] each row's last-layer streams


@dataclass(frozen=True)
class StepResult:
    sample_logits: torch.Tensor  # [S, V] float32: row i for the i-th chunk that samples
    sampled: torch.Tensor | None  # [S] int64 tokens a decode graph drew (and counted) itself, else None
    prompt_logits: dict[str, torch.Tensor]  # request_id -> [n, V] logits of every token of its chunk (CPU)
    routed_experts: dict[str, torch.Tensor]  # request_id -> [n, L, k] int16 routed experts of its chunk (CPU)
    prompt_hidden: dict[str, torch.Tensor] | None = None  # request_id -> [n, D] float32 hidden states (CPU)
    # request_id -> [k + 1, V] float32 logits at every position of its verify chunk (device)
    verify_logits: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # request_id -> [m, n, D] last-layer streams at its chunk's last m positions (`kept_streams`; device)
    streams: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # request_id -> [k + 1] the argmax the decode graph's race took at each verify position (greedy steps)
    verify_argmax: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def merged_results(results: list[StepResult]) -> StepResult:
    """Step results of consecutive chunk groups as one (sample rows in chunk order; the parts of one
    verify chunk joined in order)."""
    def joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        grouped: dict[str, list[torch.Tensor]] = {}
        for part in parts:
            for key, value in part.items():
                grouped.setdefault(key, []).append(value)
        return {key: torch.cat(values) for key, values in grouped.items()}

    return StepResult(
        torch.cat([r.sample_logits for r in results]),
        None,
        joined([r.prompt_logits for r in results]),
        joined([r.routed_experts for r in results]),
        joined([r.prompt_hidden or {} for r in results]),
        joined([r.verify_logits for r in results]),
        joined([r.streams for r in results]),
    )
