"""What an RL trainer needs from rollouts: routed experts (R3) and their replay, and live weight
updates that behave like a fresh engine on the new weights."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from antumbra.replicas.model.model import DeepseekV4
from antumbra.replicas.weights import WeightUpdateError

PROMPT = [(5 * i) % 250 + 5 for i in range(150)]
ROLLOUT = SamplingParams(max_tokens=24, temperature=1.0, seed=5, logprobs=0, return_routed_experts=True,
                         ignore_eos=True)
SCHED = SchedulerConfig(max_num_seqs=4, max_model_len=1024)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The worked example's small-vocabulary model (`antumbra.rl.example.TOY_SPEC`): rollouts score
    ids, and the replay bound below is a float32 bound over its 512 logits (over V4's 129,280 the
    same replay parted from the rollout by 1.7e-5 in one run: summation order over that many terms)."""
    from antumbra.rl.example import make_toy_checkpoint

    return make_toy_checkpoint(tmp_path_factory.mktemp("rl-toy"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)


def _trainer_logprobs(engine: Engine, out, replay: torch.Tensor | None) -> torch.Tensor:
    """log p(token) of each generated token, recomputed over the whole sequence in one pass."""
    seq = out.prompt_token_ids + out.token_ids
    scored = engine.training.score(seq, replay_experts=replay)
    logprobs = torch.log_softmax(scored.prompt_logits.double(), dim=-1)
    start = len(out.prompt_token_ids) - 1
    return torch.stack([logprobs[start + i, t] for i, t in enumerate(out.token_ids)])


def _perturbed(model: DeepseekV4, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        name: t + scale * t.std() * torch.randn(t.shape, generator=g)
        for name, t in model.state_dict().items()
        if t.is_floating_point() and name.endswith("gate.weight")
    }


def test_routed_experts_cover_every_token_the_model_read(engine):
    out = engine.generate([PROMPT], ROLLOUT)[0]
    cfg = engine.model_config
    n = len(PROMPT) + len(out.token_ids) - 1
    assert out.routed_experts is not None and out.routed_experts.dtype == torch.int16
    assert tuple(out.routed_experts.shape) == (n, cfg.num_layers, cfg.num_experts_per_tok)
    assert int(out.routed_experts.min()) >= 0 and int(out.routed_experts.max()) < cfg.num_experts
    # Requests that do not ask get none, and the scoring pass reports the same routing.
    assert engine.generate([PROMPT], SamplingParams(max_tokens=2))[0].routed_experts is None
    scored = engine.training.score(out.prompt_token_ids + out.token_ids)
    assert torch.equal(scored.routed_experts[:n], out.routed_experts)


def test_replaying_the_routing_reproduces_the_rollouts_logprobs(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)
    out = engine.generate([PROMPT], ROLLOUT)[0]
    rollout = torch.tensor(
        [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)], dtype=torch.float64
    )
    replayed = _trainer_logprobs(engine, out, out.routed_experts)
    assert (replayed - rollout).abs().max() <= 1e-5
    # After an update of the routers the free routing flips experts and the logprobs jump; replaying
    # the rollout's routing keeps them close (only the routing weights moved).
    engine.training.update_weights(_perturbed(engine.model, 0.5), version="perturbed")
    free = _trainer_logprobs(engine, out, None)
    kept = _trainer_logprobs(engine, out, out.routed_experts)
    assert not torch.equal(
        engine.training.score(out.prompt_token_ids + out.token_ids).routed_experts[: len(out.routed_experts)],
        out.routed_experts,
    )
    assert (free - rollout).abs().max() > 1e-3
    assert (kept - rollout).abs().max() < (free - rollout).abs().max()


def test_a_bad_replay_is_refused(engine):
    from antumbra.replicas.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="replayed experts"):
        engine.training.score(PROMPT, replay_experts=torch.zeros(3, 1, 1, dtype=torch.int16))
    cfg = engine.model_config
    bad = torch.full((3, cfg.num_layers, cfg.num_experts_per_tok), cfg.num_experts, dtype=torch.int16)
    with pytest.raises(InvalidRequestError, match="expert ids"):
        engine.training.score(PROMPT, replay_experts=bad)


def test_update_weights_equals_a_fresh_engine_on_the_new_weights(tiny_checkpoint):
    live = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    before = live.generate([PROMPT], params)[0]
    assert live.cached_block_hashes()
    new = {name: t + 0.05 * torch.randn_like(t) for name, t in live.model.state_dict().items()
           if t.is_floating_point()}
    assert live.training.update_weights(new, version="step-1") == len(new)
    assert live.training.weights_version == "step-1" and live.cached_block_hashes() == []
    after = live.generate([PROMPT], params)[0]
    assert after.weights_version == "step-1" and before.weights_version == "0"

    model = DeepseekV4(live.model_config)
    model.load_state_dict({**live.model.state_dict(), **new})
    fresh = Engine(model, live.tokenizer, live.config).generate([PROMPT], params)[0]
    assert after.token_ids == fresh.token_ids and after.logprobs == fresh.logprobs
    assert after.token_ids != before.token_ids
    live.check_integrity()


def test_a_bad_update_changes_nothing(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = engine.generate([PROMPT], params)[0].token_ids
    version = engine.training.weights_version
    name = next(iter(engine.model.state_dict()))
    with pytest.raises(WeightUpdateError, match="unknown"):
        engine.training.update_weights(
            {name: engine.model.state_dict()[name] * 2, "no.such.tensor": torch.zeros(1)}, "x"
        )
    with pytest.raises(WeightUpdateError, match="mis-shaped"):
        engine.training.update_weights({name: torch.zeros(1)}, "x")
    assert engine.training.weights_version == version
    assert engine.generate([PROMPT], params)[0].token_ids == before


def test_requests_in_flight_finish_on_the_old_weights(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)
    long_run = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    started = threading.Event()
    versions: dict[str, str] = {}

    async def stream() -> None:
        async for out in engine.stream(PROMPT, long_run):
            started.set()
            versions["in_flight"] = out.weights_version

    runner = threading.Thread(target=lambda: asyncio.run(stream()))
    runner.start()
    assert started.wait(60)
    update = engine.training.queue_weights(_perturbed(engine.model, 0.1), "v2")
    late = engine.generate([[9, 8, 7]], SamplingParams(max_tokens=2))[0]  # submitted after the update
    runner.join(120)
    assert update.result(60) > 0
    assert versions["in_flight"] == "0" and late.weights_version == "v2"
    engine.check_integrity()
