"""A release-layout checkpoint written tensor by tensor (`ReleaseShardWriter`, experts a block at a
time) stores what `save_release_checkpoint` stores for the same weights, in shards of the size asked."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from antumbra.replicas.model.checkpoint import hf_expected, load_state_dict
from antumbra.replicas.model.checkpoint_files import INDEX_FILE
from antumbra.replicas.model.release_format import (
    ReleaseShardWriter,
    expert_block_tensors,
    release_tensors,
    save_release_checkpoint,
)
from antumbra.replicas.model.tiny import TinyModelSpec, build_model

EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _stored(path):
    """Every stored tensor of a checkpoint directory, by name, whatever its shards."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})  # noqa: SIM118
    return out


def test_streamed_checkpoint_stores_what_the_one_shot_writer_stores(tmp_path):
    spec = TinyModelSpec(seed=3)
    model = build_model(spec)
    state = model.state_dict()
    whole = save_release_checkpoint(state, model.config, tmp_path / "whole")

    writer = ReleaseShardWriter(tmp_path / "streamed", shard_size_bytes=64 << 10)
    for name, value in state.items():
        if not name.endswith(EXPERTS):
            writer.add(release_tensors(name, value))
    block = 3  # does not divide the expert count: the last block is short
    for layer in range(spec.num_layers):
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]
        for first in range(0, gate_up.shape[0], block):
            writer.add(expert_block_tensors(layer, first, gate_up[first : first + block],
                                            down[first : first + block]))
    streamed = writer.finish(model.config)

    ours, theirs = _stored(streamed), _stored(whole)
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name].view(torch.uint8),
                                                                 tensor.view(torch.uint8)), name
    shards = sorted(streamed.glob("*.safetensors"))
    assert len(shards) > 2 and not list(streamed.glob("*.tmp"))
    index = json.loads((streamed / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(ours)
    assert {index["weight_map"][n] for n in ours} == {s.name for s in shards}
    # A weight and its scale share a shard.
    assert all(index["weight_map"][n] == index["weight_map"][n.removesuffix(".scale") + ".weight"]
               for n in ours if n.endswith(".scale"))
    expected = hf_expected(model.config)
    loaded = load_state_dict(streamed, expected, progress=False).state_dict
    reference = load_state_dict(whole, expected, progress=False).state_dict
    assert all(torch.equal(loaded[n], reference[n]) for n in expected)


def test_release_tensors_refuses_merged_experts():
    with pytest.raises(ValueError, match="expert_block_tensors"):
        release_tensors("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 64, 32))
