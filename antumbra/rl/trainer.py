"""A small policy-gradient trainer over rollouts from a live engine (an example of use, not a
training framework): REINFORCE with group-relative advantages, corrected for the mismatch between
the rollout engine and the trainer.

Per generated token t of a rollout with sequence reward R in a group of G rollouts of one prompt:

    A      = (R - mean_G(R)) / (std_G(R) + 1e-6)                     group-relative advantage
    log p  = log pi_train(t | prefix)     recomputed by the trainer, with the rollout's routing
                                          replayed (R3), in float32 master weights
    log q  = log pi_rollout(t | prefix)   what the rollout engine reported
    r      = exp(log p - log q)           the per-token importance ratio (rollout -> trainer)
    TIS:   w = min(r, C)                  truncated importance sampling
    MIS:   w = r if 1/C <= r <= C else 0  masked importance sampling: tokens whose ratio leaves
                                          [1/C, C] carry no gradient
    loss   = -sum_t w * A * log p / num_tokens                      (w and A are constants)

C is `clip` (default 2). Without the correction the gradient is biased by the rollout engine's
numerics (bf16, other kernels); replaying the routing keeps a token's discrete expert choice the
same on both sides, so r measures numerics and not flipped experts. The trainer updates the
lm_head only: the rest of the model stays as loaded, so the trainer gets each position's final
hidden state from a scoring engine (`engine.training.score`, routing replayed) and applies its own head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from antumbra.replicas.engine import Engine

from .rollout import Rollout

HEAD = "lm_head.weight"


@dataclass(frozen=True)
class StepStats:
    loss: float
    mean_reward: float
    mean_ratio: float
    max_abs_log_ratio: float
    corrected_fraction: float  # tokens truncated (TIS) or masked (MIS)
    num_tokens: int


class PolicyGradientTrainer:
    def __init__(self, scorer: Engine, lr: float = 0.05, clip: float = 2.0, correction: str = "tis") -> None:
        if correction not in ("tis", "mis"):
            raise ValueError(f"correction must be 'tis' or 'mis', got {correction!r}")
        self.scorer = scorer
        self.clip = clip
        self.correction = correction
        weight = scorer.model.state_dict()[HEAD].detach().float().clone()
        self.head = torch.nn.Parameter(weight)  # [V, D] float32 master weights
        self.optimizer = torch.optim.Adam([self.head], lr=lr)

    def head_weights(self) -> dict[str, torch.Tensor]:
        """The updated weights to push to the engines (their dense names)."""
        return {HEAD: self.head.detach().clone()}

    def step(self, groups: Sequence[Sequence[Rollout]], rewards: Sequence[Sequence[float]]) -> StepStats:
        losses, ratios, log_ratios, corrected, all_rewards = [], [], [], 0, []
        num_tokens = 0
        flat = [rollout for group in groups for rollout in group]
        scored = self.scorer.training.score_batch([r.sequence for r in flat],
                                                  [r.routed_experts for r in flat])
        hidden = {id(r): out.prompt_hidden for r, out in zip(flat, scored, strict=True)}
        for group, group_rewards in zip(groups, rewards, strict=True):
            r = torch.tensor(group_rewards, dtype=torch.float64)
            advantages = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
            all_rewards += list(group_rewards)
            for rollout, advantage in zip(group, advantages.tolist(), strict=True):
                logp = self._trainer_logprobs(rollout, hidden[id(rollout)])  # [n] float32, with grad
                log_ratio = logp.detach().double() - rollout.logprobs
                ratio = log_ratio.exp()
                weight, changed = self._correct(ratio)
                losses.append(-(weight.float() * advantage * logp).sum())
                ratios.append(ratio)
                log_ratios.append(log_ratio.abs())
                corrected += changed
                num_tokens += len(rollout.tokens)
        loss = torch.stack(losses).sum() / max(num_tokens, 1)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        all_ratios = torch.cat(ratios)
        return StepStats(
            loss=float(loss.detach()),
            mean_reward=sum(all_rewards) / len(all_rewards),
            mean_ratio=float(all_ratios.mean()),
            max_abs_log_ratio=float(torch.cat(log_ratios).max()),
            corrected_fraction=corrected / max(num_tokens, 1),
            num_tokens=num_tokens,
        )

    def _correct(self, ratio: torch.Tensor) -> tuple[torch.Tensor, int]:
        """-> (per-token weights, how many tokens the correction changed)."""
        if self.correction == "tis":
            return ratio.clamp(max=self.clip), int((ratio > self.clip).sum())
        keep = (ratio >= 1 / self.clip) & (ratio <= self.clip)
        return torch.where(keep, ratio, torch.zeros_like(ratio)), int((~keep).sum())

    def _trainer_logprobs(self, rollout: Rollout, sequence_hidden: torch.Tensor | None) -> torch.Tensor:
        """log p of each generated token under the trainer's head; sequence_hidden: [S, D] of the
        rollout's whole sequence, scored with its routing replayed."""
        assert sequence_hidden is not None
        start = len(rollout.prompt) - 1  # the position whose logits pick the first generated token
        hidden = sequence_hidden[start : start + len(rollout.tokens)].float()  # [n, D]
        logits = hidden @ self.head.t()  # [n, V]
        targets = torch.tensor(rollout.tokens, dtype=torch.long)
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)
