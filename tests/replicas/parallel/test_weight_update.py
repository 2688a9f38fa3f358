"""Live weight updates of TP=2 and EP=2 replicas (real Ray actors, gloo on CPU): after `update_weights` from
a checkpoint directory, or from a state dict, it answers like a one-rank engine on the same new
weights and reports their version on every rank; an update that one rank's shard refuses (NaN in
rows only rank 1 reads), or that every rank refuses (a mis-shaped or missing tensor), changes
nothing on any rank and names the ranks."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from antumbra.replicas.weights import WeightUpdateError
from tests.waiting import wait_until

ATOL = 1e-4
SCHED = SchedulerConfig(max_num_seqs=2, max_model_len=1024)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 261, (n,), generator=g).tolist()


PROMPTS = [tokens(150, seed=1), tokens(40, seed=2)]
# Tensors each rank of TP=2 holds a different slice of (heads, output groups, expert rows), and the head.
SHARDED = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink", ".ffn.experts.")


def _edited(source: Path, out: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the checkpoint at `source` with its tensors edited (as tests/platform/launch/test_app.py)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    edit(weights)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _perturb(weights: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(3)
    for name, w in weights.items():
        if name == "head.weight":  # under the name save_pretrained writes
            weights[name] = w + torch.randn(w.shape, generator=g)
        elif any(key in name for key in SHARDED):
            weights[name] = w + 0.3 * w.std() * torch.randn(w.shape, generator=g)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED, tensor_parallel_size=2)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def new_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    return _edited(tiny_checkpoint, tmp_path_factory.mktemp("update") / "new", _perturb)


@pytest.fixture(scope="module")
def fresh(new_checkpoint) -> list:
    """A one-rank engine's outputs on the new checkpoint, loaded from scratch."""
    return Engine.from_pretrained(new_checkpoint, scheduler=SCHED).generate(PROMPTS, PARAMS)


def _worst(got: list, want: list) -> float:
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            worst = max(worst, max(abs(x[t] - y[t]) for t in y))
    assert worst <= ATOL
    return worst


def _rank_versions(engine: Engine) -> list[str]:
    import ray

    return [engine.training.weights_version] + ray.get([w.version.remote() for w in engine.gang.workers])


def test_an_update_any_rank_refuses_changes_no_rank(engine, tiny_checkpoint, tmp_path):
    before = engine.generate(PROMPTS, PARAMS)
    versions = _rank_versions(engine)

    def nan_in_rank_1s_rows(w: dict[str, torch.Tensor]) -> None:
        w["model.layers.1.ffn.experts.0.w1.weight"][31, 0] = float("nan")  # rows 16:32 are rank 1's

    def mis_shaped(w: dict[str, torch.Tensor]) -> None:
        w["model.layers.2.attn.wq_b.weight"] = w["model.layers.2.attn.wq_b.weight"][:96]

    def missing(w: dict[str, torch.Tensor]) -> None:
        del w["model.layers.3.attn.wo_b.weight"]

    cases = [(nan_in_rank_1s_rows, r"(?s)rank\(s\) \[1\];.*rank 1: .*non-finite"),
             (mis_shaped, r"(?s)rank\(s\) \[0, 1\];.*shape mismatch"),
             (missing, r"(?s)rank\(s\) \[0, 1\];.*missing")]
    for edit, message in cases:
        # The new weights with one break: a rank that swapped in its part would change the outputs.
        bad = _edited(tiny_checkpoint, tmp_path / edit.__name__, lambda w, edit=edit: (_perturb(w), edit(w)))
        with pytest.raises(WeightUpdateError, match=message):
            engine.training.update_weights(bad, version="bad")
        assert _rank_versions(engine) == versions
        worst = _worst(engine.generate(PROMPTS, PARAMS), before)
        print(f"{edit.__name__}: refused; max |logprob diff| to the outputs before {worst:.1e}")
    engine.check_integrity()


def test_an_update_equals_a_fresh_engine_on_the_new_checkpoint(engine, new_checkpoint, fresh):
    new = new_checkpoint
    before = engine.generate(PROMPTS, PARAMS)
    old_version = engine.training.weights_version
    assert engine.cached_block_hashes()
    assert engine.generate(PROMPTS[:1], PARAMS)[0].cached_tokens > 0  # without the update: a hit
    # A request in flight finishes on the old weights; requests submitted after the update wait for it.
    got: list = []
    done = threading.Event()

    def sink(item) -> None:
        got.append(item)
        if isinstance(item, BaseException) or item.finished:
            done.set()

    engine.submit(tokens(30, seed=7), SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), sink)
    wait_until(lambda: len(got) >= 2, 60, "the request in flight to make its first tokens", poll_s=0.01)
    update = engine.training.queue_weights(new, version="v2")  # every rank has read its shard when it returns
    in_flight = not done.is_set()
    print(f"in flight at the swap's queueing: {in_flight}, {len(got[-1].token_ids)} tokens")
    after = engine.generate(PROMPTS, PARAMS)
    assert update.result(120) > 0 and done.wait(60) and in_flight
    assert got[-1].weights_version == old_version and len(got[-1].token_ids) == 64
    assert _rank_versions(engine) == ["v2", "v2"]
    assert all(out.weights_version == "v2" and out.cached_tokens == 0 for out in after)  # cache cleared
    assert [out.token_ids for out in after] != [out.token_ids for out in before]
    print(f"TP=2 checkpoint update: max |logprob diff| to a fresh one-rank engine {_worst(after, fresh):.1e}")
    engine.check_integrity()


def test_an_ep2_replica_updates_its_experts_like_a_fresh_engine(ray_cluster, tiny_checkpoint, new_checkpoint,
                                                                 fresh):
    engine = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED, expert_parallel_size=2)
    try:
        engine.training.update_weights(new_checkpoint, version="v2")
        assert _rank_versions(engine) == ["v2", "v2"]
        worst = _worst(engine.generate(PROMPTS, PARAMS), fresh)
        print(f"EP=2 checkpoint update: max |logprob diff| to a fresh one-rank engine {worst:.1e}")
    finally:
        engine.shutdown()


def test_a_state_dict_update_is_cut_for_each_rank(engine, tiny_checkpoint):
    one = Engine.from_pretrained(tiny_checkpoint, scheduler=SCHED)
    g = torch.Generator().manual_seed(4)
    new = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in one.model.state_dict().items()
           if t.is_floating_point()}
    one.training.update_weights(new, version="sd")
    engine.training.update_weights(new, version="sd")
    assert _rank_versions(engine) == ["sd", "sd"]
    worst = _worst(engine.generate(PROMPTS, PARAMS), one.generate(PROMPTS, PARAMS))
    print(f"state-dict update: max |logprob diff| to a one-rank engine updated alike {worst:.1e}")
