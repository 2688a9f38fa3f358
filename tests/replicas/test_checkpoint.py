"""Checkpoint formats: FP8 / MXFP4 numerics, both on-disk layouts, sharding and error reporting.

Every test writes real safetensors files into a temporary directory and compares against what
transformers itself produces or loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from antumbra.replicas.model.checkpoint import expected_from_module, hf_expected, load_state_dict
from antumbra.replicas.model.checkpoint_files import CheckpointError, detect_layout, load_hf_config
from antumbra.replicas.model.quant import (
    dequant_fp8_block,
    quant_fp8_block,
    quant_mxfp4,
    unpack_mxfp4,
)
from antumbra.replicas.model.release_format import save_release_checkpoint

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def tiny_config() -> DeepseekV4Config:
    # Quantised dims are ≤ 128 or multiples of 128 (transformers infers the FP8 block from the scale
    # grid), and the MXFP4 expert input dims (hidden 128, intermediate 64) are multiples of 32.
    return DeepseekV4Config(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.5,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=16,
        layer_types=[SLIDING, CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        max_position_embeddings=512,
    )


def random_model(config: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A model whose zero-/one-initialised parameters are randomised too, so no tensor is trivial."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    trivial = ("sinks", "position_bias", "hc_base", "hc_scale", "attn_hc.base", "attn_hc.scale",
               "ffn_hc.base", "ffn_hc.scale", "norm.weight", "layernorm.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(trivial):
                p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
            elif name.endswith("tid2eid"):
                b.copy_(torch.randint(0, config.n_routed_experts, b.shape))
    return model


@pytest.fixture(scope="module")
def config() -> DeepseekV4Config:
    return tiny_config()


@pytest.fixture(scope="module")
def model(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    return random_model(config)


@pytest.fixture(scope="module")
def hf_dir(model: DeepseekV4ForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def mtp_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    q, s = quant_fp8_block(torch.randn(128, 256) * 0.05)
    return {
        "mtp.0.e_proj.weight": q,
        "mtp.0.e_proj.scale": s,
        "mtp.0.enorm.weight": torch.randn(128).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def release_dir(model, config, mtp_tensors, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("release")
    return save_release_checkpoint(model.state_dict(), config, out, mtp_state_dict=mtp_tensors)


def assert_state_dicts_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


# --------------------------------------------------------------------------------------------- numerics


def test_fp8_round_trip_within_e4m3_resolution() -> None:
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)  # N, K not multiples of 128
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    scale = s.to(torch.float32).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # Each block's scale is the smallest power of two that fits its max into e4m3's ±448.
    block_max = torch.nn.functional.max_pool2d(w.abs()[None], 128, ceil_mode=True)[0]
    assert torch.all(block_max / s.to(torch.float32) <= 448)
    assert torch.all(block_max / s.to(torch.float32) > 224)
    d = dequant_fp8_block(q, s)
    assert d.dtype == torch.float32 and d.shape == w.shape
    # Half an ulp of e4m3 (3 mantissa bits), or half its smallest subnormal step 2^-9.
    assert torch.all((d - w).abs() <= w.abs() * 2**-4 + scale * 2**-10)
    # Representable values survive a second round trip exactly.
    q2, s2 = quant_fp8_block(d)
    assert torch.equal(dequant_fp8_block(q2, s2), d)


def test_fp8_all_zero_and_tiny_blocks() -> None:
    w = torch.zeros(130, 10)
    w[129, 3] = 1e-30
    q, s = quant_fp8_block(w)
    assert s.view(torch.uint8)[0, 0] == 127  # an all-zero block gets scale 1
    assert torch.equal(dequant_fp8_block(q, s)[:128], w[:128])
    assert torch.isclose(dequant_fp8_block(q, s)[129, 3], torch.tensor(1e-30), rtol=2**-4)


def test_dequant_fp8_block_matches_transformers_bitwise() -> None:
    torch.manual_seed(0)
    q = (torch.randn(256, 384) * 100).to(torch.float8_e4m3fn)
    scale_bytes = torch.randint(100, 150, (2, 3), dtype=torch.uint8)
    s = scale_bytes.view(torch.float8_e8m0fnu)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    ours = dequant_fp8_block(q, s)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert torch.equal(dequant_fp8_block(q, scale_bytes), ours)  # raw exponent bytes read the same


def test_unpack_mxfp4_hand_built_bytes() -> None:
    # Byte j holds element 2j in its low nibble and 2j+1 in its high nibble; bit 3 of a nibble is the
    # sign; the 3-bit magnitude codes are 0, .5, 1, 1.5, 2, 3, 4, 6. One scale byte per 32 elements.
    codes = list(range(16)) * 4  # 64 elements → 32 bytes, 2 scale groups
    packed = torch.tensor([[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(32)]], dtype=torch.uint8)
    scale = torch.tensor([[128, 124]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # ×2, ×1/8
    values = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    want = torch.tensor([[v * 2 for v in values * 2] + [v / 8 for v in values * 2]])
    got = unpack_mxfp4(packed.view(torch.int8), scale)
    assert got.dtype == torch.float32 and got.shape == (1, 64)
    assert torch.equal(got, want)
    # 0xA1: low nibble 1 (+0.5) first, high nibble 0xA (−1.0) second.
    one = unpack_mxfp4(torch.full((1, 16), 0xA1, dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert one[0, :4].tolist() == [0.5, -1.0, 0.5, -1.0]


def test_mxfp4_round_trip_within_e2m1_resolution() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-4, 1, 256)
    packed, s = quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (64, 128)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (64, 8)
    scale = s.to(torch.float32).repeat_interleave(32, dim=1)
    group_max = w.abs().reshape(64, 8, 32).amax(-1)
    assert torch.all(group_max / s.to(torch.float32) <= 6)
    assert torch.all(group_max / s.to(torch.float32) > 3)
    d = unpack_mxfp4(packed, s)
    # Half the e2m1 quantum: 0.25 below 2, 0.5 below 4, 1 up to 6 (in units of the group scale).
    assert torch.all((d - w).abs() <= torch.maximum(scale * 0.25, w.abs() / 4))
    # Representable values survive a second round trip exactly (the scale may drop by a power of two
    # when a group's max rounded down to 3 or less).
    assert torch.equal(unpack_mxfp4(*quant_mxfp4(d)), d)


def test_unpack_mxfp4_matches_transformers_bitwise() -> None:
    torch.manual_seed(0)
    packed = torch.randint(-128, 128, (128, 64), dtype=torch.int8)
    s = torch.randint(110, 140, (128, 4), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    theirs = Fp8Dequantize(None)._dequantize_one(packed, s, output_dtype=torch.float32)
    assert torch.equal(unpack_mxfp4(packed, s).view(torch.int32), theirs.view(torch.int32))


def test_quantisers_preserve_sign_of_tiny_negatives() -> None:
    w = torch.tensor([[-1e-8] + [6.0] * 31])
    packed, s = quant_mxfp4(w)
    assert packed.view(torch.uint8)[0, 0] & 0xF == 0  # rounds to +0, stored canonically
    assert unpack_mxfp4(packed, s)[0, 1] == 6.0


# -------------------------------------------------------------------------------------- the hf layout


def test_save_pretrained_layout_is_the_documented_hybrid(hf_dir: Path) -> None:
    with safe_open(hf_dir / "model.safetensors", framework="pt") as fh:
        names = set(fh.keys())
        tid2eid = fh.get_slice("model.layers.0.ffn.gate.tid2eid").get_dtype()
    for name in ("model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn",
                 "model.layers.0.attn.wq_a.weight", "model.layers.0.hc_attn_fn",
                 "model.layers.1.attn.indexer.compressor.ape", "model.layers.1.ffn.gate.bias",
                 "model.layers.1.ffn.experts.7.w3.weight", "model.layers.0.ffn.shared_experts.w2.weight"):
        assert name in names, name
    assert tid2eid == "I64"
    assert detect_layout(hf_dir) == "hf"


def test_save_pretrained_layout_loads_bitwise(model, hf_dir: Path) -> None:
    want = model.state_dict()
    loaded = load_state_dict(hf_dir, expected_from_module(model))
    assert loaded.layout == "hf" and loaded.mtp_state_dict == {}
    assert_state_dicts_equal(loaded.state_dict, want)
    assert loaded.state_dict["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64


def test_sharded_save_pretrained_loads(model, config, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 3
    loaded = load_state_dict(tmp_path, hf_expected(config), dtype=torch.bfloat16)
    want = model.state_dict()
    assert list(loaded.state_dict) == list(want)
    for name, tensor in want.items():
        got = loaded.state_dict[name]
        assert got.dtype == (torch.bfloat16 if tensor.is_floating_point() else torch.int64), name
        assert torch.equal(got, tensor.to(got.dtype)), name


def test_in_memory_names_load(model, tmp_path: Path) -> None:
    want = model.state_dict()
    save_file({k: v.contiguous() for k, v in want.items()}, tmp_path / "model.safetensors")
    loaded = load_state_dict(tmp_path, expected_from_module(model), dtype=None)
    assert loaded.layout == "hf"
    assert_state_dicts_equal(loaded.state_dict, want)


# --------------------------------------------------------------------------------- the release layout


def test_release_files_use_the_release_names_and_dtypes(release_dir: Path) -> None:
    with safe_open(release_dir / "model.safetensors", framework="pt") as fh:
        dtypes = {name: fh.get_slice(name).get_dtype() for name in fh.keys()}
        shapes = {name: fh.get_slice(name).get_shape() for name in fh.keys()}
    assert dtypes["embed.weight"] == "BF16" and dtypes["head.weight"] == "BF16"
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0" and shapes["layers.0.attn.wq_a.scale"] == [1, 1]
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert shapes["layers.1.attn.indexer.wq_b.scale"] == [4, 1]
    assert dtypes["layers.1.attn.indexer.weights_proj.weight"] == "BF16"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    expert = "layers.2.ffn.experts.5"
    assert dtypes[f"{expert}.w1.weight"] == "I8" and shapes[f"{expert}.w1.weight"] == [64, 64]
    assert shapes[f"{expert}.w1.scale"] == [64, 4] and shapes[f"{expert}.w2.scale"] == [128, 2]
    assert dtypes["layers.1.attn.attn_sink"] == "F32" and dtypes["layers.1.attn.compressor.ape"] == "F32"
    assert dtypes["hc_head_fn"] == "F32" and dtypes["layers.3.hc_ffn_scale"] == "F32"
    assert dtypes["layers.1.ffn.gate.bias"] == "F32" and dtypes["layers.0.ffn.gate.tid2eid"] == "I32"
    assert dtypes["mtp.0.e_proj.scale"] == "F8_E8M0"
    config = json.loads((release_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    assert config["expert_dtype"] == "fp4"
    assert detect_layout(release_dir) == "release"


def test_release_layout_matches_transformers(model, config, release_dir: Path, mtp_tensors) -> None:
    ours = load_state_dict(release_dir, hf_expected(config))
    assert ours.layout == "release"
    theirs = DeepseekV4ForCausalLM.from_pretrained(release_dir, dtype=torch.bfloat16).state_dict()
    assert list(ours.state_dict) == list(theirs)
    for name, tensor in theirs.items():
        got = ours.state_dict[name]
        if tensor.is_floating_point():
            assert got.dtype == torch.float32
            assert torch.equal(got, tensor.float()), name
        else:
            assert torch.equal(got, tensor.long()), name
    # The release values are the original weights up to FP8 / MXFP4 / bf16 rounding.
    original = model.state_dict()
    for name in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                 "model.layers.3.mlp.experts.down_proj", "model.embed_tokens.weight"):
        err = (ours.state_dict[name] - original[name]).abs().max()
        assert 0 < err <= 0.25 * original[name].abs().max(), name
    for name in ("model.layers.1.self_attn.sinks", "model.hc_head.hc_fn", "model.layers.0.mlp.gate.tid2eid"):
        assert torch.equal(ours.state_dict[name], original[name]), name
    assert set(ours.mtp_state_dict) == set(mtp_tensors)
    for name, tensor in mtp_tensors.items():
        got = ours.mtp_state_dict[name]
        assert got.dtype == tensor.dtype, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name


def test_sharded_release_checkpoint_loads_the_same(model, config, release_dir, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    out = save_release_checkpoint(model.state_dict(), config, tmp_path / "sharded", shard_size_bytes=60_000,
                                  tokenizer_dir=src)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3
    assert index["layers.0.attn.wo_b.weight"] == index["layers.0.attn.wo_b.scale"]
    assert (out / "tokenizer.json").is_file()
    expected = hf_expected(config)
    want = load_state_dict(release_dir, expected).state_dict
    assert_state_dicts_equal(load_state_dict(out, expected).state_dict, want)


# ------------------------------------------------------------------------------------------------ errors


@pytest.fixture()
def editable_hf_dir(hf_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(hf_dir, out)
    return out


def _rewrite(ckpt: Path, edit) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def test_every_mismatch_is_reported_at_once(model, editable_hf_dir: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.2.attn.wo_a.weight"]
        del t["model.layers.1.ffn.experts.5.w3.weight"]
        t["model.layers.9.attn.wq_a.weight"] = torch.zeros(3)
        t["model.layers.0.attn.wkv.weight"] = torch.zeros(33, 128)
        t["mtp.0.norm.weight"] = torch.zeros(4)  # mtp tensors are set aside, never an error

    _rewrite(editable_hf_dir, edit)
    with pytest.raises(CheckpointError) as info:
        load_state_dict(editable_hf_dir, expected_from_module(model))
    message = str(info.value)
    assert "4 problem(s)" in message
    assert "missing tensor model.layers.2.self_attn.o_a_proj.weight (64, 64)" in message
    assert "missing tensor model.layers.1.mlp.experts.gate_up_proj[expert 5 w3]" in message
    assert "unexpected tensor model.layers.9.attn.wq_a.weight" in message
    assert ("shape mismatch model.layers.0.attn.wkv.weight -> model.layers.0.self_attn.kv_proj.weight: "
            "expected (32, 128), found (33, 128)") in message
    assert isinstance(info.value, ValueError) and len(info.value.problems) == 4


def test_wrong_expert_shape_and_count(model, editable_hf_dir: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.3.ffn.experts.2.w2.weight"] = torch.zeros(128, 65)
        t["model.layers.3.ffn.experts.8.w1.weight"] = torch.zeros(64, 128)

    _rewrite(editable_hf_dir, edit)
    with pytest.raises(CheckpointError) as info:
        load_state_dict(editable_hf_dir, expected_from_module(model))
    message = str(info.value)
    piece = "model.layers.3.mlp.experts.down_proj[expert 2 w2]"
    assert f"model.layers.3.ffn.experts.2.w2.weight -> {piece}" in message
    assert "expected (128, 64), found (128, 65)" in message
    assert "model.layers.3.ffn.experts.8.w1.weight: expert 8 beyond" in message


def test_many_problems_are_truncated(model, editable_hf_dir: Path) -> None:
    _rewrite(editable_hf_dir, lambda t: t.update({f"extra.{i}": torch.zeros(1) for i in range(30)}))
    with pytest.raises(CheckpointError) as info:
        load_state_dict(editable_hf_dir, expected_from_module(model))
    assert len(info.value.problems) == 30
    assert "... and 10 more" in str(info.value)


def test_corrupt_quantisation_scale_is_reported(config, release_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(release_dir, tmp_path / "r")
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["layers.0.attn.wq_a.scale"] = t["layers.0.attn.wq_a.scale"][:0]
        del t["layers.0.attn.wq_b.scale"]
        del t["layers.2.ffn.experts.1.w2.scale"]

    _rewrite(tmp_path / "r", edit)
    with pytest.raises(CheckpointError) as info:
        load_state_dict(tmp_path / "r", hf_expected(config))
    assert info.value.problems == (
        "FP8 scale layers.0.attn.wq_a.scale has shape (0, 1), expected (1, 1)",
        "layers.0.attn.wq_b.weight is stored as F8_E4M3 without a scale",
        "layers.2.ffn.experts.1.w2.weight is stored as I8 without a scale",
    )


def test_load_hf_config(hf_dir: Path, tmp_path: Path) -> None:
    assert load_hf_config(hf_dir).layer_types == [SLIDING, CSA, HCA, CSA]
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama'"):
        load_hf_config(tmp_path)


def test_progress_bar_and_single_file_path(model, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_state_dict(hf_dir / "model.safetensors", expected_from_module(model), progress=True)
    assert loaded.layout == "hf"
    assert "loading model.safetensors" in capsys.readouterr().err
    load_state_dict(hf_dir, expected_from_module(model))  # progress=None: off when not a tty and small
    assert capsys.readouterr().err == ""


def test_parameters_held_in_float32_load_unrounded_in_a_bfloat16_model(release_dir: Path) -> None:
    """The release stores mHC mixing, sinks and biases in float32; a bfloat16 model holds them in float32
    and must get the stored values, not ones rounded through bfloat16 on the way."""
    from antumbra.replicas.build import load_model

    exact = load_model(release_dir, "cpu", torch.float32, progress=False).model.state_dict()
    half = load_model(release_dir, "cpu", torch.bfloat16, progress=False).model.state_dict()
    held = [name for name, t in half.items() if t.dtype == torch.float32]
    assert any("_hc." in name for name in held) and any("sinks" in name for name in held), held
    for name in held:
        assert torch.equal(half[name], exact[name]), name
    assert half["model.embed_tokens.weight"].dtype == torch.bfloat16
