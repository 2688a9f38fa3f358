"""What RL training asks of an engine beyond serving: live weight updates and scoring sequences.

A mixin of `Engine` (engine.py), which provides `core`, `driver`, `plan` and `_wait_all`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .errors import InvalidRequestError
from .request import Request, RequestOutput
from .sampling_params import SamplingParams
from .validation import Prompt
from .weights import load_weights, read_checkpoint_weights

if TYPE_CHECKING:
    from .core import EngineCore
    from .driver import Driver
    from .plan import ExecutionPlan


class TrainingAPI:
    core: EngineCore
    driver: Driver
    plan: ExecutionPlan
    _wait_all: Callable[[list[Request]], list[RequestOutput]]  # Engine's: submit, wait for every one

    def update_weights(
        self, weights: Mapping[str, torch.Tensor] | str | Path, version: str, timeout_s: float | None = None
    ) -> int:
        """Replace the model's weights in place, without a restart; -> the tensors written.

        `weights`: tensors under the model's dense names, or a checkpoint directory. Requests in
        flight finish on the old weights; requests submitted meanwhile wait and run on the new
        ones, so every output's `weights_version` names the weights of all its tokens. The
        prefix cache is cleared (its KV belongs to the old weights), which the cache events tell
        the prefix directory. A bad update (unknown or mis-shaped tensors) raises and changes
        nothing.

        On a parallel replica every rank reads its own shard of the checkpoint (or its slices of
        the state dict, cut on rank 0) and checks it, and only when all have does every rank swap,
        between two steps; if any rank fails, none changes and the error names it
        (`parallel/weight_sync.py`)."""
        return self.queue_weights(weights, version).result(timeout_s)

    def queue_weights(self, weights: Mapping[str, torch.Tensor] | str | Path, version: str) -> Future:
        """`update_weights` without waiting: the update is queued when this returns (so requests
        submitted after it run on the new weights); -> a future of the tensors written."""
        gang = getattr(self, "gang", None)
        if gang is not None and not isinstance(weights, Mapping) and not Path(weights).is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {weights}")
        if gang is None and not isinstance(weights, Mapping):
            weights = read_checkpoint_weights(weights, self.core.model, self.plan.dtype)
        source = dict(weights) if isinstance(weights, Mapping) else Path(weights)
        plan = self.plan

        def apply(core: EngineCore) -> int:
            if gang is not None:  # every rank re-reads its shard; all swap or none (parallel/weight_sync.py)
                written = gang.update_weights(core.model, plan, source, str(version))
            else:
                assert not isinstance(source, Path)
                written = load_weights(core.model, source)
            if core.kv.tree is not None:
                core.kv.tree.clear()
            core.weights_version = str(version)
            return written

        return self.driver.update(apply)

    @property
    def weights_version(self) -> str:
        return self.core.weights_version

    def score(
        self, prompt: Prompt, *, replay_experts: torch.Tensor | None = None, namespace: str = "default"
    ) -> RequestOutput:
        """The prompt's logits, final hidden states and routing at every position, computed with
        `replay_experts` [S', L, k] where given (routing replay): what a trainer recomputes a
        rollout with. -> `prompt_logits` [S, V], `prompt_hidden` [S, D], `routed_experts` [S, L, k]."""
        return self.score_batch([prompt], [replay_experts], namespace=namespace)[0]

    def score_batch(
        self,
        prompts: Sequence[Prompt],
        replay_experts: Sequence[torch.Tensor | None],
        *,
        namespace: str = "default",
    ) -> list[RequestOutput]:
        """`score` of several prompts, in flight together (batched like any requests)."""
        if len(replay_experts) != len(prompts):
            raise InvalidRequestError("one replay (or None) per prompt", "replay_experts")
        params = SamplingParams(max_tokens=1, temperature=0.0, return_routed_experts=True)
        requests = [
            self.core.make_request(p, params, namespace=namespace, want_prompt_logits=True,
                                   want_prompt_hidden=True, replay_experts=replay)
            for p, replay in zip(prompts, replay_experts, strict=True)
        ]
        return self._wait_all(requests)
