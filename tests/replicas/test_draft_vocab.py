"""A draft vocabulary (token map): the drafter scores a subset of the vocabulary with those rows of the
target's LM head. The head's logits equal the target's on the subset and are -inf elsewhere, and
follow a weight update written in place; a bad map is refused, naming its file. In the engine, on the
distilled tiny target, greedy output with a token map equals plain decoding on both decode paths, and
drafts are accepted with the map distillation wrote (the target's own frequent tokens); with a map of
tokens the target never says, none is accepted and the output is still the plain one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from antumbra.config import FastPathConfig
from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.speculative.draft_vocab import (
    TOKEN_MAP_FILE,
    DraftHead,
    load_token_map,
    write_token_map,
)
from tests.replicas.stepping import run_by_hand
from tests.replicas.test_speculative_engine import assert_same_output, build, prompts


def test_head_scores_the_subset_as_the_target_and_nothing_else() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)
    hidden = torch.randn(3, 16, generator=gen)
    ids = [7, 3, 41, 0]
    head = DraftHead(weight, ids)
    logits = head(hidden)
    full = hidden @ weight.t()
    assert logits.shape == (3, 50) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[:, ids], full[:, ids])
    off = [i for i in range(50) if i not in ids]
    assert torch.isneginf(logits[:, off]).all()
    assert set(logits.argmax(dim=-1).tolist()) <= set(ids)

    with torch.no_grad():
        weight[41].mul_(-3.0)  # a live weight update writes the head in place
    storage = head.weight.data_ptr()
    head.refresh()
    assert head.weight.data_ptr() == storage  # a captured draft step keeps reading the same rows
    torch.testing.assert_close(head(hidden)[:, 41], (hidden @ weight.t())[:, 41])


@pytest.mark.parametrize("ids, message", [([1, 1], "distinct"), ([], "distinct"), ([3, 50], r"\[0, 50\)")])
def test_a_bad_subset_is_refused(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DraftHead(torch.zeros(50, 4), ids)


def test_token_map_files(tmp_path: Path) -> None:
    path = write_token_map(tmp_path / "map.json", [[5, 5, 9, 2], [9, 5]], size=2)
    assert load_token_map(path) == [5, 9]  # most frequent first
    for text in ("{not json", json.dumps({"ids": [1]}), json.dumps([]), json.dumps([1, "2"])):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="bad.json"):
            load_token_map(bad)
    with pytest.raises(ValueError, match="missing.json"):
        load_token_map(tmp_path / "missing.json")


@pytest.mark.parametrize("path", ["general", "fixed_shape"])
def test_greedy_speculation_with_a_token_map_equals_plain_decoding(distilled_checkpoint: Path, path: str,
                                                                    tmp_path: Path) -> None:
    fixed = path == "fixed_shape"  # its kernels interpreted here: a shorter run
    fast = FastPathConfig(decode="on" if fixed else "off", cuda_graph_batch_sizes=(1, 2, 4, 8))
    batch = prompts(1 if fixed else 3, 20, seed=23)
    params = SamplingParams(max_tokens=8 if fixed else 24, temperature=0.0, logprobs=0, ignore_eos=True)
    want = run_by_hand(build(distilled_checkpoint, 0, fast=fast), batch, params)
    said = {t for o in want for t in o.token_ids}

    written = distilled_checkpoint / TOKEN_MAP_FILE
    engine = build(distilled_checkpoint, 3, fast=fast, speculative_token_map=str(written))
    got = run_by_hand(engine, batch, params)
    assert_same_output(got, want)
    assert sum(o.num_accepted_tokens for o in got) > 0
    if fixed:
        return

    vocab = engine.model_config.vocab_size
    unsaid = tmp_path / "unsaid.json"
    unsaid.write_text(json.dumps([t for t in range(vocab) if t not in said][:64]))
    engine = build(distilled_checkpoint, 3, fast=fast, speculative_token_map=str(unsaid))
    got = run_by_hand(engine, batch, params)
    assert_same_output(got, want)
    assert sum(o.num_drafted_tokens for o in got) > 0 and sum(o.num_accepted_tokens for o in got) == 0


def test_a_bad_token_map_fails_the_engine_start_naming_it(distilled_checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "ids.json"
    bad.write_text(json.dumps([0, 10**9]))
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        build(distilled_checkpoint, 3, speculative_token_map=str(bad))
    with pytest.raises(ValueError, match="nothing.json"):
        build(distilled_checkpoint, 3, speculative_token_map=str(tmp_path / "nothing.json"))
