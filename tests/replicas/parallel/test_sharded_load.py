"""Sharded streaming loading of a release-layout checkpoint (FP8 linears, MXFP4 experts): every
rank of a TP=2 x EP=2 replica holds exactly its shard (bytes counted, values equal to the cut
of the one-rank load), and a broken checkpoint is named per rank. In-process, no Ray."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from antumbra.config import ModelConfig
from antumbra.replicas.build import param_dtype
from antumbra.replicas.model.checkpoint import load_state_dict
from antumbra.replicas.model.checkpoint_files import CheckpointError, load_hf_config
from antumbra.replicas.model.model import DeepseekV4
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import TinyModelSpec, build_model, mtp_tensors
from antumbra.replicas.parallel.layers import build_rank_model, shard_tensor
from antumbra.replicas.parallel.loader import load_shard
from antumbra.replicas.parallel.spec import ShardSpec


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    # MXFP4 columns of a TP=2 down projection must stay 32-aligned: intermediate 64 -> 32 per rank.
    spec = TinyModelSpec(seed=5, moe_intermediate_size=64)
    model = build_model(spec)
    return save_release_checkpoint(model.state_dict(), model.config, tmp_path_factory.mktemp("release"),
                                   mtp_state_dict=mtp_tensors(spec), shard_size_bytes=400_000)


def test_each_rank_holds_exactly_its_shard(release_dir):
    cfg = ModelConfig.from_hf(load_hf_config(release_dir))
    with torch.device("meta"):
        full_model = DeepseekV4(cfg)
    expected = {n: (tuple(t.shape), param_dtype(n, t, torch.float32))
                for n, t in full_model.state_dict().items()}
    whole = load_state_dict(release_dir, expected, dtype=torch.float32).state_dict
    full_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    spec = ShardSpec(tp_size=2, ep_size=2)
    held = []
    for rank in range(spec.world_size):
        rank_spec = spec.for_rank(rank)
        model = build_rank_model(cfg, rank_spec, None)
        loaded = load_shard(release_dir, cfg, rank_spec, model, torch.device("cpu"), torch.float32)
        want_bytes = sum(math.prod(rank_spec.local_shape(n, shape, cfg)) * dt.itemsize
                         for n, (shape, dt) in expected.items())
        assert loaded.bytes_held == want_bytes
        assert set(loaded.state_dict) == set(model.state_dict())
        for name, value in loaded.state_dict.items():
            assert torch.equal(value, shard_tensor(whole[name], name, rank_spec, cfg)), f"rank {rank}: {name}"
        model.load_state_dict(loaded.state_dict, strict=True, assign=True)
        held.append(loaded.bytes_held)
        print(f"rank {rank}: holds {loaded.bytes_held} B of {full_bytes} B, read {loaded.bytes_read} B, "
              f"peak RSS {loaded.peak_rss_bytes / 2**20:.0f} MiB")
    experts = sum(whole[n].numel() * 4 for n in whole if ".mlp.experts." in n)
    # Routed experts split four ways, attention heads two ways, the rest replicated.
    assert all(h < full_bytes - experts * 3 // 4 for h in held)


def test_a_missing_tensor_is_named_per_rank(release_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in release_dir.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            tensors.pop("layers.1.attn.wq_b.weight", None)
            tensors.pop("layers.1.attn.wq_b.scale", None)
            save_file(tensors, str(broken / f.name), metadata={"format": "pt"})
        elif f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (broken / f.name).write_text(f.read_text())
    cfg = ModelConfig.from_hf(load_hf_config(broken))
    spec = ShardSpec(tp_size=2, ep_size=1, rank=1)
    named = r"rank 1: missing tensor model\.layers\.1\.self_attn\.q_b_proj"
    with pytest.raises(CheckpointError, match=named):
        load_shard(broken, cfg, spec, build_rank_model(cfg, spec, None), torch.device("cpu"), torch.float32)


def test_packed_shards_load_as_stored(release_dir):
    """With MXFP4 experts and FP8 linears kept packed, each rank's buffers are the stored codes
    and scales of its slice: they decode to exactly its cut of the one-rank model's values."""
    from antumbra.replicas.model.fp8_linear import Fp8Linear, pack_fp8_linears
    from antumbra.replicas.model.packed_experts import PackedExperts, pack_experts
    from antumbra.replicas.model.quant import dequant_fp8_block

    cfg = ModelConfig.from_hf(load_hf_config(release_dir))
    with torch.device("meta"):
        full_model = DeepseekV4(cfg)
    expected = {n: (tuple(t.shape), param_dtype(n, t, torch.float32))
                for n, t in full_model.state_dict().items()}
    whole = load_state_dict(release_dir, expected, dtype=torch.float32).state_dict
    spec = ShardSpec(tp_size=2, ep_size=2)
    for rank in range(spec.world_size):
        rank_spec = spec.for_rank(rank)
        model = build_rank_model(cfg, rank_spec, None)
        assert pack_experts(model) == cfg.num_layers and pack_fp8_linears(model) > 0
        loaded = load_shard(release_dir, cfg, rank_spec, model, torch.device("cpu"), torch.float32)
        model.load_state_dict(loaded.state_dict, strict=True, assign=True)
        assert loaded.bytes_held == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        for name, module in model.named_modules():
            if isinstance(module, PackedExperts):
                gate_up, down = module.dense_weights()
                assert torch.equal(gate_up, shard_tensor(whole[f"{name}.gate_up_proj"],
                                                         f"{name}.gate_up_proj", rank_spec, cfg))
                assert torch.equal(down, shard_tensor(whole[f"{name}.down_proj"], f"{name}.down_proj",
                                                      rank_spec, cfg))
            elif isinstance(module, Fp8Linear):
                value = dequant_fp8_block(module.weight, module.weight_scale)
                want = shard_tensor(whole[f"{name}.weight"], f"{name}.weight", rank_spec, cfg)
                assert torch.equal(value, want), f"rank {rank}: {name}"
        print(f"rank {rank}: packed shard {loaded.bytes_held} B (read {loaded.bytes_read} B)")
