"""The real-MoE benchmark's parts on a CPU: its checkpoint, written a block of experts at a time,
loads through `Engine.from_pretrained` with every expert; the experts it counts as touched by a
decode step are those the routing (R3) names, which for a hash layer is the fed tokens' own row
of `tid2eid`."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from antumbra import Engine, SamplingParams
from antumbra.config import SchedulerConfig
from benchmarks.engine.real_moe import experts_touched
from benchmarks.engine.real_moe_checkpoint import write_real_moe_checkpoint
from benchmarks.lib.decode_floor import decode_floor_bytes
from benchmarks.lib.slices import SMOKE_REAL_MOE, prompts


@pytest.fixture(scope="module")
def real_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real-moe")
    write_real_moe_checkpoint(out, SMOKE_REAL_MOE, "cpu")
    return out


@pytest.fixture(scope="module")
def engine(real_moe_dir: Path) -> Engine:
    return Engine.from_pretrained(real_moe_dir, scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512))


def test_the_checkpoint_holds_every_expert_and_loads(real_moe_dir: Path, engine: Engine) -> None:
    names = set()
    for file in real_moe_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as fh:
            names.update(fh.keys())
    experts = {n for n in names if ".ffn.experts." in n and n.endswith(".weight")}
    layers = len(SMOKE_REAL_MOE.layer_types)
    assert len(experts) == layers * SMOKE_REAL_MOE.n_routed_experts * 3
    cfg = engine.model_config
    assert cfg.num_experts == SMOKE_REAL_MOE.n_routed_experts and cfg.num_experts_per_tok == 6
    assert cfg.mlp_layer_types == ("hash_moe", "hash_moe", "hash_moe", "moe")
    for layer in engine.model.model.layers:
        assert layer.mlp.experts.gate_up_proj.shape[0] == SMOKE_REAL_MOE.n_routed_experts
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_touched_experts_follow_the_routing(engine: Engine) -> None:
    batch = prompts(SMOKE_REAL_MOE.vocab_size, 3, 40, seed=1)
    steps = 3
    outs = engine.generate(batch, SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True))
    generated = [list(o.token_ids) for o in outs]
    touched = experts_touched(engine, batch, generated, steps)
    state = engine.model.state_dict()
    for layer in range(3):  # hash layers: each fed token's row of tid2eid
        table = state[f"model.layers.{layer}.mlp.gate.tid2eid"]
        want = [len(set(table[[g[j] for g in generated]].flatten().tolist())) for j in range(steps)]
        assert touched["per_layer"][layer] == pytest.approx(sum(want) / steps)
    k = engine.model_config.num_experts_per_tok
    assert all(k <= n <= min(16, 3 * k) for n in touched["per_layer"])
    floor = decode_floor_bytes(engine, 3, 40, touched["per_layer"])
    everything = decode_floor_bytes(engine, 3, 40, [16.0] * 4)
    expert_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if ".experts." in n)
    assert everything["expert_bytes"] == pytest.approx(expert_bytes)
    assert floor["expert_bytes"] == pytest.approx(
        sum(expert_bytes / 4 * n / 16 for n in touched["per_layer"]))
