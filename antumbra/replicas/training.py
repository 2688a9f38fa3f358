"""What RL training asks of an engine beyond serving: live weight updates and scoring sequences.

`Training` is one part of an `Engine` (`engine.training`), built over the engine's core and driver:
it queues weight swaps on the driver (between steps) and submits scoring requests as any caller
does. It holds no state of its own; the weights' version lives on the core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .awaiting import wait_all
from .errors import InvalidRequestError
from .request import RequestOutput
from .sampling_params import SamplingParams
from .validation import Prompt
from .weights import load_weights, read_checkpoint_weights

if TYPE_CHECKING:
    from .core import EngineCore
    from .driver import Driver
    from .plan import ExecutionPlan


class Training:
    def __init__(self, core: EngineCore, driver: Driver, plan: ExecutionPlan, gang: Any = None) -> None:
        """`gang`: the other ranks of a parallel replica (`parallel/gang.py`), which take every
        weight update with rank 0; None for a replica of one rank."""
        self.core = core
        self.driver = driver
        self.plan = plan
        self.gang = gang

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
        the state dict, cut on rank 0) and checks it here, while the replica serves on; only when
        all have is the swap queued, which every rank makes between the same two steps. If any
        rank fails, none changes and the error names it (`parallel/weight_sync.py`)."""
        return self.queue_weights(weights, version).result(timeout_s)

    def queue_weights(self, weights: Mapping[str, torch.Tensor] | str | Path, version: str) -> Future:
        """`update_weights` without waiting: the update is queued when this returns (so requests
        submitted after it run on the new weights; a checkpoint has been read by then); -> a
        future of the tensors written."""
        gang = self.gang
        staged, state = None, {}
        if gang is not None:  # every rank reads and checks its shard now; all swap or none (parallel/)
            if not isinstance(weights, Mapping) and not Path(weights).is_dir():
                raise FileNotFoundError(f"no checkpoint directory at {weights}")
            source = dict(weights) if isinstance(weights, Mapping) else Path(weights)
            staged = gang.prepare_weights(self.core.model, self.plan, source, str(version))
        elif isinstance(weights, Mapping):
            state = dict(weights)
        else:
            state = read_checkpoint_weights(weights, self.core.model, self.plan.dtype)

        def apply(core: EngineCore) -> int:
            written = gang.swap_weights(staged) if gang is not None else load_weights(core.model, state)
            if core.kv.tree is not None:
                core.kv.tree.clear()
            core.weights_version = str(version)
            return written

        return self.driver.update(apply)

    @property
    def weights_version(self) -> str:
        """The version the last update installed ("0" for the weights the engine was built with)."""
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
        return wait_all(self.driver, requests)
