"""The MTP draft block: tiny checkpoints carry one in the release's formats without changing the
target, it loads through the target's dequantisation (both name prefixes, sharded or not), it is
written back losslessly for release-format values, and its window cache gives chunked calls the
logits of one whole-sequence call."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from antumbra.config import CSA, HCA, SLIDING
from antumbra.replicas.build import load_model
from antumbra.replicas.model.checkpoint_files import INDEX_FILE, CheckpointError, weight_files
from antumbra.replicas.model.mtp import MTPWindowCache
from antumbra.replicas.model.mtp_names import plan_name, read_back_
from antumbra.replicas.model.quant import dequant_fp8_block, unpack_mxfp4
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import (
    MTP_FILE,
    TinyModelSpec,
    build_model,
    make_tiny_checkpoint,
    mtp_tensors,
)
from antumbra.replicas.speculative.mtp_loading import load_mtp, write_mtp
from antumbra.replicas.speculative.plain_forward import plain_forward

SPEC = TinyModelSpec(vocab_size=512, used_vocab_size=256, sliding_window=16, layer_types=(SLIDING, CSA, HCA),
                     compress_rates={CSA: 4, HCA: 16})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "model", SPEC, with_tokenizer=False)


def test_tiny_checkpoint_has_an_mtp_block_and_the_same_target(tiny: Path, tmp_path: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    without = make_tiny_checkpoint(tmp_path / "plain", replace(SPEC, num_mtp_layers=0), with_tokenizer=False)
    assert not (without / MTP_FILE).exists()
    ours, theirs = load_file(tiny / "model.safetensors"), load_file(without / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    stored = load_file(tiny / MTP_FILE)
    # Release formats: FP8 attention and input projections with scales, MXFP4 experts, float32 mixing.
    assert stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn and "mtp.0.e_proj.scale" in stored
    assert stored["mtp.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["mtp.0.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert stored["mtp.0.hc_head_fn"].dtype == torch.float32
    assert stored["mtp.0.hc_attn_fn"].dtype == torch.float32
    assert stored["mtp.0.enorm.weight"].dtype == torch.bfloat16
    assert "mtp.0.ffn.gate.bias" in stored and "mtp.0.ffn.gate.tid2eid" not in stored  # score-routed


def test_load_dequantises_as_the_release_stores(tiny: Path) -> None:
    block = load_mtp(tiny)
    stored = load_file(tiny / MTP_FILE)
    state = block.state_dict()
    e_proj = dequant_fp8_block(stored["mtp.0.e_proj.weight"], stored["mtp.0.e_proj.scale"], 128)
    assert torch.equal(state["e_proj.weight"], e_proj.float())
    w1 = unpack_mxfp4(stored["mtp.0.ffn.experts.2.w1.weight"], stored["mtp.0.ffn.experts.2.w1.scale"])
    half = state["layer.mlp.experts.gate_up_proj"].shape[1] // 2
    assert torch.equal(state["layer.mlp.experts.gate_up_proj"][2, :half], w1.float())
    assert torch.equal(state["hc_head.hc_fn"], stored["mtp.0.hc_head_fn"])
    assert torch.equal(state["layer.attn_hc.base"], stored["mtp.0.hc_attn_base"])
    assert torch.equal(state["layer.mlp.gate.e_score_correction_bias"], stored["mtp.0.ffn.gate.bias"])
    assert torch.equal(state["enorm.weight"], stored["mtp.0.enorm.weight"].float())


def test_hybrid_prefix_and_sharded_release_load_the_same(tiny: Path, tmp_path: Path) -> None:
    block = load_mtp(tiny)
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    for name in ("config.json", "model.safetensors"):
        (hybrid / name).write_bytes((tiny / name).read_bytes())
    # The hybrid prefix, and the KV norm under the module's own name (as released MTP shards store it).
    renamed = {k.replace("attn.norm.", "attn.kv_norm."): v for k, v in load_file(tiny / MTP_FILE).items()}
    prefixed = {f"model.{k}": v for k, v in renamed.items()}
    save_file(prefixed, str(hybrid / "extra.safetensors"))
    assert_same_block(load_mtp(hybrid), block)

    model = build_model(SPEC)
    sharded = save_release_checkpoint(model.state_dict(), model.config, tmp_path / "release",
                                      mtp_state_dict=mtp_tensors(SPEC), shard_size_bytes=200_000)
    assert (sharded / INDEX_FILE).is_file()
    assert_same_block(load_mtp(sharded), block)


def assert_same_block(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_missing_mtp_tensors_are_named(tiny: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.safetensors"):
        (broken / name).write_bytes((tiny / name).read_bytes())
    stored = load_file(tiny / MTP_FILE)
    del stored["mtp.0.h_proj.weight"], stored["mtp.0.h_proj.scale"]
    save_file(stored, str(broken / MTP_FILE))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.h_proj.weight"):
        load_mtp(broken)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=1"):
        load_mtp(tiny, index=1)


def test_write_back_round_trips_and_replaces_old_copies(tiny: Path, tmp_path: Path) -> None:
    model = build_model(SPEC)
    release = save_release_checkpoint(model.state_dict(), model.config, tmp_path / "release",
                                      mtp_state_dict=mtp_tensors(SPEC))
    block = load_mtp(release)
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(0.5)  # powers of two keep FP8 / MXFP4 values representable: the round trip is exact
    write_mtp(release, [block])
    files = weight_files(release)  # no duplicate names across files
    assert {f.name for n, f in files.items() if "mtp." in n} == {MTP_FILE}
    with safe_open(release / "model.safetensors", framework="pt") as fh:
        assert not [k for k in fh.keys() if k.startswith("mtp.")]
    assert_same_block(load_mtp(release), block)
    target = load_model(release, "cpu", torch.float32, progress=False).model.state_dict()
    again = load_model(tiny, "cpu", torch.float32, progress=False).model.state_dict()
    assert target["model.layers.0.self_attn.sinks"].equal(again["model.layers.0.self_attn.sinks"])

    sharded = save_release_checkpoint(model.state_dict(), model.config, tmp_path / "sharded",
                                      mtp_state_dict=mtp_tensors(SPEC), shard_size_bytes=200_000)
    write_mtp(sharded, [block])
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert {f for n, f in weight_map.items() if n.startswith("mtp.")} == {MTP_FILE}
    assert_same_block(load_mtp(sharded), block)


def test_read_back_in_memory_gives_the_block_written_and_loaded(tiny: Path, tmp_path: Path) -> None:
    """`read_back_` (what distillation trains through) rounds every weight exactly as writing the block
    in the release's formats and loading it again does, for weights no format represents exactly."""
    model = build_model(SPEC)
    release = save_release_checkpoint(model.state_dict(), model.config, tmp_path / "release",
                                      mtp_state_dict=mtp_tensors(SPEC))
    block = load_mtp(release)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(1 + 0.3 * torch.rand(p.shape, generator=gen))  # off every format's grid
    state = {name: p.detach().clone() for name, p in block.named_parameters()}
    read_back_(state)
    write_mtp(release, [block])
    loaded = dict(load_mtp(release).named_parameters())
    changed = [name for name, p in block.named_parameters() if not torch.equal(state[name], p)]
    assert {"e_proj.weight", "layer.mlp.experts.gate_up_proj", "layer.self_attn.q_a_proj.weight",
            "enorm.weight"} <= set(changed)  # FP8, MXFP4 and bfloat16 weights all rounded
    assert torch.equal(state["hc_head.hc_fn"], block.hc_head.hc_fn)  # float32 kept
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name


def test_plan_names_follow_the_layer_names() -> None:
    assert plan_name("layer.self_attn.q_a_proj.weight", 0) == "model.layers.0.self_attn.q_a_proj.weight"
    assert plan_name("hc_head.hc_fn", 2) == "model.layers.2.hc_head_fn"
    with pytest.raises(KeyError):
        plan_name("lm_head.weight", 0)


@torch.no_grad()
def test_chunked_calls_through_the_window_cache_equal_one_call(tiny: Path) -> None:
    """Two sequences, chunks of varying length (short and long attention paths), the window crossed
    many times: every chunk's logits and streams equal the whole-sequence call's."""
    model = load_model(tiny, "cpu", torch.float32, progress=False).model
    block = load_mtp(tiny)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(2, 256, (90,), generator=gen).tolist() for _ in range(2)]
    hidden = [plain_forward(model, s).streams for s in seqs]
    whole = []
    for s, h in zip(seqs, hidden, strict=True):
        cache = MTPWindowCache(model.config, 1, 89, torch.float32, "cpu")
        whole.append(block(model, h[None, :89], torch.tensor([s[1:90]]), [0], cache))
    cache = MTPWindowCache(model.config, 2, 40, torch.float32, "cpu")
    pos = 0
    for n in (1, 5, 33, 2, 1, 17, 7, 40):
        n = min(n, 89 - pos)
        if n == 0:
            break
        out = block(model, torch.stack([h[pos : pos + n] for h in hidden]),
                    torch.tensor([s[pos + 1 : pos + 1 + n] for s in seqs]), [pos, pos], cache)
        for b in range(2):
            torch.testing.assert_close(out.logits[b], whole[b].logits[0, pos : pos + n], atol=1e-4, rtol=0)
            torch.testing.assert_close(out.streams[b], whole[b].streams[0, pos : pos + n], atol=1e-5, rtol=0)
        pos += n
    assert pos == 89
    with pytest.raises(ValueError, match="1..40"):
        cache.step_index([0, 0], 41)


@torch.no_grad()
def test_block_matches_transformers_layer_and_head(tiny: Path) -> None:
    """Oracle: transformers' own V4 layer, hc_head, norm and head carrying the block's weights, fed the
    official MTP input x = e_proj(enorm(embed(ids))) + h_proj(hnorm(h)) written out here."""
    from transformers import DeepseekV4ForCausalLM

    from antumbra.replicas.model.tiny import build_config

    model = load_model(tiny, "cpu", torch.float32, progress=False).model
    block = load_mtp(tiny)
    config = build_config(SPEC)
    config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 1, [SLIDING], ["moe"]
    oracle = DeepseekV4ForCausalLM(config).float().eval()
    state = {f"model.layers.0.{k.removeprefix('layer.')}": v for k, v in block.state_dict().items()
             if k.startswith("layer.")}
    state |= {"model.hc_head." + k.split(".")[-1]: v for k, v in block.state_dict().items()
              if k.startswith("hc_head.")}
    state |= {"model.norm.weight": block.norm.weight, "lm_head.weight": model.lm_head.weight,
              "model.embed_tokens.weight": model.model.embed_tokens.weight}
    oracle.load_state_dict(state, strict=True)

    seq = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    h = plain_forward(model, seq).streams[:39]  # [39, n, D]
    nxt = torch.tensor(seq[1:])

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w

    e = rms(model.model.embed_tokens.weight[nxt], block.enorm.weight) @ block.e_proj.weight.T  # [39, D]
    x = rms(h, block.hnorm.weight) @ block.h_proj.weight.T + e[:, None, :]  # [39, n, D]

    def feed(_module, args, kwargs):
        return (x[None], *args[1:]), kwargs

    oracle.model.layers[0].register_forward_pre_hook(feed, with_kwargs=True)
    want = oracle(input_ids=nxt[None], position_ids=torch.arange(39)[None]).logits[0]
    cache = MTPWindowCache(model.config, 1, 39, torch.float32, "cpu")
    got = block(model, h[None], nxt[None], [0], cache).logits[0]
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@torch.no_grad()
def test_release_numerics_reach_the_block_layer(tiny: Path) -> None:
    """In release numerics the block's linears read FP8-rounded inputs and its KV rows keep FP8
    codes: the logits move, a little, and back again in exact numerics."""
    from antumbra.replicas.model.numerics import EXACT, Numerics

    model = load_model(tiny, "cpu", torch.float32, progress=False).model
    block = load_mtp(tiny)
    seq = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    h = plain_forward(model, seq).streams[None, :29]
    ids = torch.tensor([seq[1:]])

    def logits() -> torch.Tensor:
        return block(model, h, ids, [0], MTPWindowCache(model.config, 1, 29, torch.float32, "cpu")).logits

    exact = logits()
    block.set_numerics(Numerics.of("release"))
    assert block.layer.self_attn.numerics.act_fp8 and block.layer.mlp.experts.numerics.act_fp8
    release = logits()
    assert 0 < float((release - exact).abs().max()) < 0.2 * float(exact.abs().max())
    block.set_numerics(EXACT)
    assert torch.equal(logits(), exact)


@torch.no_grad()
def test_block_packs_into_the_release_formats_like_the_target(tiny: Path) -> None:
    """The target's packing (MXFP4 experts, FP8 linears) applies to the block as it stands; packing
    values loaded from the release's formats is lossless, so only the kernels' summation order moves
    the logits."""
    from antumbra.replicas.model.fp8_linear import Fp8Linear, pack_fp8_linears
    from antumbra.replicas.model.packed_experts import PackedExperts, pack_experts

    model = load_model(tiny, "cpu", torch.float32, progress=False).model
    block = load_mtp(tiny)
    seq = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(10)).tolist()
    h = plain_forward(model, seq).streams[None, :29]
    ids = torch.tensor([seq[1:]])

    def logits() -> torch.Tensor:
        return block(model, h, ids, [0], MTPWindowCache(model.config, 1, 29, torch.float32, "cpu")).logits

    dense = logits()
    assert pack_experts(block) == 1 and pack_fp8_linears(block) > 0
    assert isinstance(block.layer.mlp.experts, PackedExperts)
    assert isinstance(block.layer.self_attn.q_a_proj, Fp8Linear)
    torch.testing.assert_close(logits(), dense, atol=1e-4, rtol=0)
