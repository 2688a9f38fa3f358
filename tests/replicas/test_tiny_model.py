"""Tiny checkpoints: what they hold, that transformers loads them bit-exactly, that they are not
degenerate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: E402
from safetensors import safe_open

from antumbra.cli import default_tiny_model_dir, main
from antumbra.config import CSA, HASH_MOE, HCA, SCORE_MOE, SLIDING, ModelConfig
from antumbra.replicas.chat.v4_tokens import V4_VOCAB_SIZE
from antumbra.replicas.model.tiny import TinyModelSpec, build_model, make_tiny_checkpoint
from antumbra.replicas.model.tokenizer import v4_tokenizer_file

SPEC = TinyModelSpec()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(out, SPEC)
    saved = {k: v.clone() for k, v in build_model(SPEC).state_dict().items()}
    return out, saved


@pytest.fixture(scope="module")
def loaded(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> torch.nn.Module:
    return transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()


def test_reloaded_state_dict_is_bitwise_identical(checkpoint, loaded) -> None:
    _, saved = checkpoint
    reloaded = loaded.state_dict()
    assert reloaded.keys() == saved.keys()
    for name, tensor in saved.items():
        assert reloaded[name].dtype == tensor.dtype, name
        assert torch.equal(reloaded[name], tensor), name


def test_generation_is_deterministic_and_seeded() -> None:
    a = build_model(SPEC).state_dict()
    b = build_model(SPEC).state_dict()
    c = build_model(TinyModelSpec(seed=1)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_config_covers_every_kind_at_real_rates(checkpoint) -> None:
    cfg = transformers.AutoConfig.from_pretrained(checkpoint[0])
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {HASH_MOE, SCORE_MOE}
    assert cfg.sliding_window == 128
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn"
    assert compress["factor"] == 16 and compress["original_max_position_embeddings"] == 65536
    assert compress["beta_fast"] == 32 and compress["beta_slow"] == 1
    assert cfg.rope_parameters["main"]["rope_type"] == "default"
    assert cfg.vocab_size == V4_VOCAB_SIZE  # the checkpoint carries V4's tokenizer.json
    # The raw file carries the modern keys only.
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    assert "compress_ratios" not in raw and raw["layer_types"] == list(SPEC.layer_types)
    model_cfg = ModelConfig.from_hf(cfg)
    assert model_cfg.compress_rope.yarn_factor == 16.0
    assert model_cfg.rope_dim == SPEC.rope_dim
    gen = json.loads((checkpoint[0] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1 and gen["bos_token_id"] == 0


def test_no_special_tensor_is_left_at_its_default(loaded) -> None:
    special = ("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")
    names = [n for n in loaded.state_dict() if any(n.endswith(s) for s in special)]
    kinds = {s for s in special for n in names if n.endswith(s)}
    assert kinds == set(special)
    for name in names:
        assert loaded.state_dict()[name].abs().min() > 0, name
    for name, t in loaded.state_dict().items():
        if name.endswith("scale") or name.endswith("norm.weight"):
            assert not torch.equal(t, torch.ones_like(t)), name


def test_tid2eid_rows_are_distinct_valid_experts(loaded) -> None:
    tables = [t for n, t in loaded.state_dict().items() if n.endswith("tid2eid")]
    assert tables
    for table in tables:
        assert table.shape == (SPEC.vocab_size, SPEC.num_experts_per_tok)
        assert table.min() >= 0 and table.max() < SPEC.n_routed_experts
        ordered = table.sort(dim=1).values
        assert (ordered[:, 1:] != ordered[:, :-1]).all()
        assert table.unique(dim=0).shape[0] > 1  # routing differs per token


def test_saved_file_uses_the_save_pretrained_layout(checkpoint) -> None:
    with safe_open(checkpoint[0] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.ffn.gate.tid2eid").dtype == torch.int64
    for key in (
        "head.weight",
        "model.embed_tokens.weight",
        "model.hc_head.hc_fn",
        "model.layers.0.attn.attn_sink",
        "model.layers.1.attn.compressor.ape",
        "model.layers.1.attn.indexer.wq_b.weight",
        "model.layers.1.ffn.gate.bias",
        "model.layers.1.ffn.experts.0.w1.weight",
        "model.layers.2.hc_attn_base",
    ):
        assert key in keys, key


def test_forward_logits_are_finite_and_spread(loaded) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V4_VOCAB_SIZE, (1, 300), generator=gen)
    with torch.no_grad():
        logits = loaded(ids).logits[0]
    assert torch.isfinite(logits).all()
    std = logits.std(dim=-1)
    assert 0.5 < std.min() and std.max() < 50
    # Greedy picks vary along the sequence.
    picks = logits.argmax(dim=-1)
    assert logits.shape[-1] == V4_VOCAB_SIZE and picks.unique().numel() > 10


def test_cli_make_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-model"
    assert main(["make-tiny-model", str(out), "--seed", "3", "--layers", "csa", "hca"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["layer_types"] == [CSA, HCA]
    assert raw["mlp_layer_types"] == [HASH_MOE, SCORE_MOE]
    assert (out / "tokenizer.json").read_bytes() == v4_tokenizer_file().read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert cfg.sliding_window == 128 and cfg.compress_rates == {CSA: 4, HCA: 128}


def test_default_tiny_model_is_generated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTUMBRA_CACHE_DIR", str(tmp_path / "cache"))
    first = default_tiny_model_dir()
    assert first == tmp_path / "cache" / "tiny-model"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in first.parent.iterdir()) == ["tiny-model"]  # no staging leftovers
    raw = json.loads((first / "config.json").read_text())
    assert raw["layer_types"] == list(SPEC.layer_types)
    # One generated by an older version (another tokenizer) is replaced.
    (first / "tokenizer.json").write_text("{}")
    assert default_tiny_model_dir() == first
    assert (first / "tokenizer.json").read_bytes() == v4_tokenizer_file().read_bytes()


def test_spec_rejects_bad_schedules(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        TinyModelSpec(layer_types=("full_attention",))
    with pytest.raises(ValueError):
        TinyModelSpec(layer_types=(SLIDING, CSA), mlp_layer_types=(HASH_MOE,))
    with pytest.raises(ValueError):
        make_tiny_checkpoint(tmp_path / "small-vocab", TinyModelSpec(vocab_size=100))
    assert not (tmp_path / "small-vocab").exists()
