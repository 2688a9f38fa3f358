"""RL on a live engine: rollouts with logprobs and routed experts, a trainer that recomputes them
with the routing replayed and corrects for the mismatch (TIS / MIS), and the weight sync back.

An example of use beside the serving path: nothing the platform runs imports it.
`python -m antumbra.rl.example` runs the toy loop.
"""

from .rollout import Rollout, RolloutClient
from .trainer import PolicyGradientTrainer, StepStats

__all__ = ["PolicyGradientTrainer", "Rollout", "RolloutClient", "StepStats"]
