"""The toy RL loop: teach the tiny model to emit one token.

Rollouts come from one engine (batched decode steps), the trainer scores them on another in
float32 with the rollouts' routing replayed (one pass over each sequence); `--rollout-dtype
bfloat16` samples in bfloat16 as a serving engine would, for a larger mismatch for TIS / MIS to
correct (bfloat16 matmuls are slow on a CPU). Reward of a rollout: the fraction of its generated
tokens equal to the target token.
After each step the trainer's lm_head goes to the rollout engine through `engine.training.update_weights`.

    python -m antumbra.rl.example [--model DIR] [--steps 30] [--correction tis|mis] [--rollout-dtype D]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from antumbra.config import SchedulerConfig
from antumbra.replicas.engine import Engine
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

from .rollout import RolloutClient
from .trainer import PolicyGradientTrainer, StepStats, mean

log = logging.getLogger(__name__)

TARGET_TOKEN = 42
# The default model: a small vocabulary (no tokenizer; prompts are ids), so a random model emits the
# target now and then and the reward has a signal from the first step (in V4's 129,280 ids it never does).
TOY_SPEC = TinyModelSpec(vocab_size=512, used_vocab_size=256)


def make_toy_checkpoint(out_dir: str | Path) -> Path:
    return make_tiny_checkpoint(out_dir, TOY_SPEC, with_tokenizer=False)
PROMPTS = [[5, 72, 101, 108, 108, 111], [5, 84, 104, 101], [5, 79, 110, 99, 101]]


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 30
    group_size: int = 8
    max_tokens: int = 12
    lr: float = 0.05
    correction: str = "tis"
    rollout_dtype: str = "float32"


def run(model_dir: str | Path, config: LoopConfig = LoopConfig()) -> list[StepStats]:
    sched = SchedulerConfig(max_num_seqs=64, max_model_len=256)
    rollout_engine = Engine.from_pretrained(model_dir, dtype=config.rollout_dtype, scheduler=sched)
    scorer = Engine.from_pretrained(model_dir, dtype="float32", scheduler=sched)
    client = RolloutClient(rollout_engine, config.max_tokens)
    trainer = PolicyGradientTrainer(scorer, lr=config.lr, correction=config.correction)
    history = []
    for step in range(config.steps):
        groups = client.sample_groups(PROMPTS, config.group_size, seed=step)
        rewards = [[r.tokens.count(TARGET_TOKEN) / len(r.tokens) for r in group] for group in groups]
        stats = trainer.step(groups, rewards)
        rollout_engine.training.update_weights(trainer.head_weights(), version=f"step-{step + 1}")
        history.append(stats)
        log.info("step %d: %s", step, asdict(stats))
    return history


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a checkpoint directory (default: a tiny random one, `TOY_SPEC`)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--correction", default="tis", choices=("tis", "mis"))
    parser.add_argument("--rollout-dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = make_toy_checkpoint(Path(tmp) / "tiny")
        history = run(model, LoopConfig(steps=args.steps, correction=args.correction,
                                        rollout_dtype=args.rollout_dtype))
    first, last = mean([s.mean_reward for s in history[:5]]), mean([s.mean_reward for s in history[-5:]])
    print(f"mean reward: first 5 steps {first:.4f}, last 5 steps {last:.4f} ({last / max(first, 1e-9):.1f}x) "
          f"in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
