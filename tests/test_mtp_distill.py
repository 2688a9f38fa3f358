"""The MTP draft block distilled on a tiny target, and the reference speculative decoder with it.

One distillation (a few hundred steps on the CPU) is shared by the tests: the written-back block is read
from the checkpoint again, drafts for held-aside prompts with an accept length above 1.5 at k = 3
(tokens emitted per target verify step, the bonus token included), and greedy speculation with it
equals plain greedy decoding, tokens and logprobs, at k = 1, 3, 5. The serving dtype's path (bfloat16
engine, target and block, float32 master weights) trains too, on the CPU and, marked `gpu`, on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from antumbra.replicas.build import load_model
from antumbra.replicas.model.model import DeepseekV4
from antumbra.replicas.model.mtp import MTPBlock
from antumbra.replicas.model.tiny import make_tiny_checkpoint
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.speculative.mtp_loading import load_mtp
from antumbra.replicas.speculative.reference import plain_decode, speculative_decode
from antumbra.rl.mtp_distill import (
    DISTILL_SPEC,
    DistillConfig,
    DistillResult,
    crop_start,
    distill,
    distill_loss,
    random_prompts,
)

CONFIG = DistillConfig()
NEW_TOKENS = 24


@dataclass(frozen=True)
class Distilled:
    model: DeepseekV4
    random_block: MTPBlock
    block: MTPBlock
    result: DistillResult
    held_aside: list[list[int]]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory) -> Iterator[Distilled]:
    # Steps of a few hundred small ops each: one thread spends far less time waiting for the others.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("distill") / "tiny", DISTILL_SPEC,
                                      with_tokenizer=False)
    random_block = load_mtp(path)
    result = distill(path, CONFIG)
    model = load_model(path, "cpu", torch.float32, progress=False).model
    # Other prompts than the ones distilled on (another seed), from the same token ids.
    ids = (2, DISTILL_SPEC.padded_vocab_start)
    held_aside = random_prompts(4, CONFIG.prompt_tokens, ids, CONFIG.seed + 1)
    yield Distilled(model, random_block, load_mtp(path), result, held_aside)
    torch.set_num_threads(threads)


def accept_length(d: Distilled, block: MTPBlock, k: int) -> float:
    runs = [speculative_decode(d.model, block, p, NEW_TOKENS, k) for p in d.held_aside]
    return sum(r.accepted + r.verify_steps for r in runs) / sum(r.verify_steps for r in runs)


def test_distillation_lowers_the_loss_and_writes_the_block_back(distilled: Distilled) -> None:
    result = distilled.result
    assert result.last_loss < 0.5 * result.first_loss
    assert result.written.is_file()
    # It trained through the release's rounding: the block written back is the one its last step ran,
    # over every sequence; the unrounded masters are another block.
    assert result.written_loss == pytest.approx(result.trained_loss, rel=1e-5)
    assert result.master_loss != result.written_loss
    trained, random = distilled.block.state_dict(), distilled.random_block.state_dict()
    assert not torch.equal(trained["e_proj.weight"], random["e_proj.weight"])


def test_distilled_block_accept_length_at_k3_on_held_aside_prompts(distilled: Distilled) -> None:
    before = accept_length(distilled, distilled.random_block, 3)
    after = accept_length(distilled, distilled.block, 3)
    assert after > 1.5
    assert after > before


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_plain_greedy_decoding(distilled: Distilled, k: int) -> None:
    prompt = distilled.held_aside[0]
    plain = plain_decode(distilled.model, prompt, NEW_TOKENS)
    spec = speculative_decode(distilled.model, distilled.block, prompt, NEW_TOKENS, k)
    assert spec.tokens == plain.tokens
    torch.testing.assert_close(torch.tensor(spec.logprobs), torch.tensor(plain.logprobs), atol=1e-5, rtol=0)
    assert spec.drafted == k * spec.verify_steps
    assert 0 < spec.accepted <= spec.drafted  # both the accept and the reject branch ran
    assert spec.accepted < spec.drafted


def test_sampled_speculation_repeats_with_its_seed(distilled: Distilled) -> None:
    params = SamplingParams(temperature=1.0, top_k=20)
    prompt = distilled.held_aside[1]
    a = speculative_decode(distilled.model, distilled.block, prompt, 12, 3, params, seed=5)
    b = speculative_decode(distilled.model, distilled.block, prompt, 12, 3, params, seed=5)
    c = speculative_decode(distilled.model, distilled.block, prompt, 12, 3, params, seed=6)
    assert a == b
    assert a.tokens != c.tokens


def test_distillation_in_bfloat16_on_given_long_prompts_lowers_the_loss(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tiny", DISTILL_SPEC, with_tokenizer=False)
    before = load_mtp(path).state_dict()
    # Prompts longer than two windows: the block trains on cropped sequences (`crop_start`).
    prompts = random_prompts(8, 30, (2, DISTILL_SPEC.padded_vocab_start), seed=9)
    result = distill(path, DistillConfig(steps=20, dtype="bfloat16"), prompts)
    assert result.last_loss < 0.8 * result.first_loss
    assert result.written_loss == pytest.approx(result.trained_loss, rel=1e-5)
    assert not torch.equal(load_mtp(path).state_dict()["e_proj.weight"], before["e_proj.weight"])


def test_a_block_distilled_on_the_served_text_drafts_it_where_it_is_served(tmp_path: Path) -> None:
    """The H200 benchmark's setting on the tiny target: the block learns the very text a bfloat16
    engine serves (handed to `distill` as continuations), and a speculating bfloat16 engine then
    accepts most of its drafts on those prompts, with the served tokens unchanged."""
    from antumbra.replicas.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = make_tiny_checkpoint(tmp_path / "tiny", DISTILL_SPEC, with_tokenizer=False)
        prompts = random_prompts(8, 16, (2, DISTILL_SPEC.padded_vocab_start), seed=11)
        greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        plain = Engine.from_pretrained(path, dtype="bfloat16")
        served = [o.token_ids for o in plain.generate(prompts, greedy)]
        result = distill(path, DistillConfig(steps=300, dtype="bfloat16"), prompts, served)
        assert result.written_loss < 0.05

        outs = Engine.from_pretrained(path, dtype="bfloat16", speculative_tokens=3,
                                      speculative_max_batch=len(prompts)).generate(prompts, greedy)
        steps = sum(o.num_drafted_tokens for o in outs) / 3
        accept = (sum(o.num_accepted_tokens for o in outs) + steps) / steps
        assert [o.token_ids for o in outs] == served and accept > 3.0
        with pytest.raises(ValueError, match="one continuation each"):
            distill(path, DistillConfig(steps=1), prompts, served[1:])
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def test_a_sequence_cropped_before_two_windows_gives_the_same_loss(distilled: Distilled) -> None:
    cfg = distilled.model.config
    gen = torch.Generator().manual_seed(3)
    first_target, length = 40, 56
    ids = torch.randint(2, DISTILL_SPEC.padded_vocab_start, (2, length), generator=gen)
    hidden = torch.randn(2, length, cfg.hc_mult, cfg.hidden_size, generator=gen)
    offset = crop_start(first_target, cfg.sliding_window)
    assert offset > 0
    full = distill_loss(distilled.model, distilled.block, ids, hidden, first_target, 0.5)
    cropped = distill_loss(distilled.model, distilled.block, ids[:, offset:], hidden[:, offset:],
                           first_target - offset, 0.5, offset)
    torch.testing.assert_close(cropped, full)


@pytest.mark.gpu
def test_distillation_on_a_gpu_in_bfloat16_drafts_what_the_target_says(tmp_path: Path) -> None:
    """The CUDA path: the target's kernels serve the greedy text and the forward, the block trains on
    the differentiable chains; the block read back drafts as the CPU-distilled one does (reference
    decoder, float32 on the CPU) and the bfloat16 engine on the GPU accepts its drafts."""
    from antumbra import Engine

    path = make_tiny_checkpoint(tmp_path / "tiny", DISTILL_SPEC, with_tokenizer=False)
    result = distill(path, DistillConfig(device="cuda", dtype="bfloat16"))
    assert result.last_loss < 0.5 * result.first_loss
    assert result.written_loss == pytest.approx(result.trained_loss, rel=1e-3)
    model = load_model(path, "cpu", torch.float32, progress=False).model
    block = load_mtp(path)
    ids = (2, DISTILL_SPEC.padded_vocab_start)
    held_aside = random_prompts(4, CONFIG.prompt_tokens, ids, CONFIG.seed + 1)
    runs = [speculative_decode(model, block, p, NEW_TOKENS, 3) for p in held_aside]
    assert sum(r.accepted + r.verify_steps for r in runs) / sum(r.verify_steps for r in runs) > 1.5
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", speculative_tokens=3,
                                    speculative_max_batch=len(held_aside))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(held_aside, params)
    assert sum(o.num_accepted_tokens for o in outs) > 0


def test_command_line_distils_a_checkpoint_in_place(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tiny", DISTILL_SPEC, with_tokenizer=False)
    before = load_mtp(path).state_dict()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "antumbra.rl.mtp_distill", "--model", str(path), "--steps", "3",
         "--prompts", "4", "--continuation", "6"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout
    after = load_mtp(path).state_dict()
    assert after.keys() == before.keys()
    assert not torch.equal(after["h_proj.weight"], before["h_proj.weight"])
