"""Rollouts from a live engine, with what a trainer needs to score them again.

A `Rollout` is one sampled completion: its prompt and generated tokens, the logprob the rollout
engine gave each generated token, the experts every MoE layer chose at every position the model
read (R3), and the weights version that produced it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from antumbra.replicas.engine import Engine
from antumbra.replicas.sampling_params import SamplingParams


@dataclass(frozen=True)
class Rollout:
    prompt: list[int]
    tokens: list[int]  # generated
    logprobs: torch.Tensor  # [n] float64: the rollout engine's log p of each generated token
    routed_experts: torch.Tensor  # [len(prompt) + n - 1, L, k] int16
    weights_version: str

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


class RolloutClient:
    """Samples groups of rollouts (several completions of one prompt) from an engine."""

    def __init__(self, engine: Engine, max_tokens: int, temperature: float = 1.0) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.temperature = temperature

    def sample_groups(self, prompts: Sequence[list[int]], group_size: int, seed: int) -> list[list[Rollout]]:
        """`group_size` completions of each prompt, all in flight together; seeds follow `seed`."""
        params = [
            SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=seed * 100_003 + i,
                           logprobs=0, return_routed_experts=True, ignore_eos=True)
            for i in range(len(prompts) * group_size)
        ]
        flat = [p for p in prompts for _ in range(group_size)]
        outs = asyncio.run(self._generate(flat, params))
        rollouts = [
            Rollout(
                prompt=list(out.prompt_token_ids),
                tokens=list(out.token_ids),
                logprobs=torch.tensor(
                    [lp[t] for lp, t in zip(out.logprobs or [], out.token_ids, strict=True)],
                    dtype=torch.float64,
                ),
                routed_experts=out.routed_experts if out.routed_experts is not None else torch.empty(0),
                weights_version=out.weights_version,
            )
            for out in outs
        ]
        return [rollouts[i : i + group_size] for i in range(0, len(rollouts), group_size)]

    async def _generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list:
        async def one(prompt: list[int], p: SamplingParams):
            last = None
            async for out in self.engine.stream(prompt, p):
                last = out
            return last

        return list(
            await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params, strict=True)))
        )
