"""A release-layout checkpoint (FP8 linears, MXFP4 experts) written here loads in the engine
and gives the logits transformers gives on its own loading of the same directory."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from antumbra import Engine, SamplingParams
from antumbra.replicas.model.release_format import save_release_checkpoint
from antumbra.replicas.model.tiny import TinyModelSpec, build_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    # Quantised widths stay <= 128 (the reference infers FP8 block sizes from scale grids)
    # and MXFP4 inputs are multiples of 32.
    spec = TinyModelSpec(seed=5)
    model = build_model(spec)
    mtp = {"mtp.0.e_proj.weight": torch.randn(spec.hidden_size, spec.hidden_size).to(torch.bfloat16)}
    return save_release_checkpoint(model.state_dict(), model.config, tmp_path_factory.mktemp("release"),
                                   mtp_state_dict=mtp)


def test_release_layout_matches_transformers(release_dir):
    engine = Engine.from_pretrained(release_dir, device="cpu", dtype="float32")
    assert set(engine.mtp_state_dict) == {"mtp.0.e_proj.weight"}
    reference = DeepseekV4ForCausalLM.from_pretrained(release_dir, dtype=torch.bfloat16).float().eval()
    g = torch.Generator().manual_seed(0)
    for length in (1, 5, 131, 300):
        ids = torch.randint(5, engine.model_config.vocab_size, (length,), generator=g).tolist()
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0].float()
        ours = engine.prompt_logits(ids)
        err = (ours - theirs).abs().max().item()
        assert err < ATOL, f"{length}-token prompt differs by {err}"
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    engine.check_integrity()
