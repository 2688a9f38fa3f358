"""`n > 1` on a model replica (without Ray): the prompt is computed once and the choices reuse its
cached pages; each choice has its own index, finish reason and reproducible seed. And the logit
adjustments through the engine: its token history feeds the penalties step after step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from antumbra.config import SchedulerConfig
from antumbra.platform.messages import GenerateRequest
from antumbra.platform.replica.model_server import ModelServer
from antumbra.replicas.choices import choice_seed
from antumbra.replicas.errors import InvalidRequestError
from antumbra.replicas.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ModelServer]:
    config = {"scheduler": SchedulerConfig(max_model_len=1024)}
    server = ModelServer("tiny", str(tiny_checkpoint), engine_kwargs=config)
    yield server
    server.engine.shutdown()


def _prompt(length: int, salt: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(10, min(vocab, 250), (length,), generator=g).tolist()


def _run(server: ModelServer, request: GenerateRequest) -> list[dict]:
    async def collect() -> list[dict]:
        return [dict(item) async for item in server.generate(request)]

    return asyncio.run(collect())


def _by_choice(items: list[dict]) -> dict[int, dict]:
    """Per choice index: its token ids, finish reason and cached tokens."""
    out: dict[int, dict] = {}
    for item in items:
        assert "status" not in item, item
        choice = out.setdefault(item["index"], {"token_ids": [], "finish_reason": None})
        choice["token_ids"] += item["token_ids"]
        choice["finish_reason"] = item["finish_reason"]
        choice["cached_tokens"] = item["cached_tokens"]
    return out


def test_n_choices_compute_the_prompt_once(server: ModelServer) -> None:
    info = server.get_model_info()
    page = info["page_size"]
    prompt = _prompt(2 * page + 37, 1, info["vocab_size"])
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    before = server.engine.stats()
    items = _run(server, GenerateRequest("cmpl-n3", prompt, params, namespace="tiny:choices", n=3))
    after = server.engine.stats()
    choices = _by_choice(items)
    assert sorted(choices) == [0, 1, 2]
    shared = (len(prompt) - 1) // page * page  # every full page but one that holds the last token
    for choice in choices.values():
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
        assert choice["cached_tokens"] == shared
    # The prompt once, then each choice only the tokens past the shared pages.
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    assert computed == len(prompt) + 3 * (len(prompt) - shared)
    assert after["num_running"] == 0 and after["request_vpages"] == 0

    # Reproducible with the seed; choice 0 draws what n = 1 draws, the others their own seeds.
    again = _by_choice(_run(server, GenerateRequest("cmpl-n3b", prompt, params, namespace="tiny:choices",
                                                    n=3)))
    assert {i: c["token_ids"] for i, c in again.items()} == {i: c["token_ids"] for i, c in choices.items()}
    for index in range(3):
        alone = SamplingParams(max_tokens=5, temperature=1.0, seed=choice_seed(11, index), ignore_eos=True)
        request = GenerateRequest(f"cmpl-1-{index}", prompt, alone, namespace="tiny:choices")
        one = _by_choice(_run(server, request))
        assert one[0]["token_ids"] == choices[index]["token_ids"]
    assert len({tuple(c["token_ids"]) for c in choices.values()}) > 1


def test_engine_generate_n_gives_the_platforms_choices(server: ModelServer) -> None:
    info = server.get_model_info()
    page = info["page_size"]
    prompts = [_prompt(page + 21, 3, info["vocab_size"]), _prompt(2 * page + 5, 4, info["vocab_size"])]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=29, ignore_eos=True)
    platform = [
        _by_choice(_run(server, GenerateRequest(f"cmpl-e{k}", p, params, namespace="tiny:platform-n", n=3)))
        for k, p in enumerate(prompts)
    ]
    before = server.engine.stats()
    outs = server.engine.generate(prompts, params, namespace="tiny:engine-n", n=3)
    after = server.engine.stats()
    # Prompt-major: the three choices of prompt 0, then those of prompt 1, as the platform draws them.
    assert [o.token_ids for o in outs] == [platform[k][i]["token_ids"] for k in range(2) for i in range(3)]
    shared = [(len(p) - 1) // page * page for p in prompts]
    assert [o.cached_tokens for o in outs] == [s for s in shared for _ in range(3)]
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    assert computed == sum(len(p) + 3 * (len(p) - s) for p, s in zip(prompts, shared, strict=True))
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    with pytest.raises(InvalidRequestError, match="n must be"):
        server.engine.generate(prompts, params, n=0)


def test_choice_seeds_are_distinct_and_in_range() -> None:
    assert choice_seed(None, 2) is None and choice_seed(5, 0) == 5
    seeds = {choice_seed(2**64 - 1, i) for i in range(128)}
    assert len(seeds) == 128 and all(0 <= s < 2**64 for s in seeds)
    SamplingParams(seed=choice_seed(-(2**63), 3))  # a valid engine seed


def _greedy_with_penalties(server: ModelServer, prompt: list[int], params: SamplingParams) -> list[int]:
    """The penalised greedy tokens computed by hand: the model's logits for the sequence so far
    (a fresh namespace, nothing cached), adjusted by the definitions, then argmax."""
    engine = server.engine
    bias = dict(params.logit_bias)
    out: list[int] = []
    for step in range(params.max_tokens):
        logits = engine.prompt_logits(prompt + out, namespace=f"tiny:oracle-{step}")[-1].double()
        for token in set(prompt) | set(out):
            value = logits[token] + bias.get(token, 0.0)
            rep = params.repetition_penalty
            logits[token] = value / rep if value > 0 else value * rep
        for token, value in bias.items():
            if token not in set(prompt) | set(out):
                logits[token] += value
        for token in set(out):
            logits[token] -= out.count(token) * params.frequency_penalty + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


def test_penalties_follow_the_generated_history(server: ModelServer) -> None:
    vocab = server.get_model_info()["vocab_size"]
    prompt = _prompt(9, 2, vocab)
    # Penalties that favour repeats (the tiny model's greedy answer repeats nothing by itself), so
    # counts above one and tokens seen in the prompt both change the answer.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0,
                            presence_penalty=-2.0, repetition_penalty=0.5,
                            logit_bias={prompt[0]: 2.0, 7: -5.0})
    want = _greedy_with_penalties(server, prompt, params)
    got = server.engine.generate([prompt], params, namespace="tiny:penalised")[0].token_ids
    assert got == want, (got, want)
    assert len(set(got)) < len(got)  # some token repeats: its count grew past one
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert server.engine.generate([prompt], plain, namespace="tiny:plain")[0].token_ids != want


def test_logit_bias_forces_a_token(server: ModelServer) -> None:
    vocab = server.get_model_info()["vocab_size"]
    target = vocab - 3
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True,
                            logit_bias={target: 100.0})
    assert server.engine.generate([[5, 6, 7]], params)[0].token_ids == [target] * 4
