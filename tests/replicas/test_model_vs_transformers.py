"""The engine against transformers' DeepSeek-V4 on the same tiny checkpoints, in fp32 on CPU.

Several configurations: the real window and rates, a short window with other rates
and another layer order, and odd widths. Every prompt position's logits must agree
within 1e-4 around every boundary (window, each rate), and greedy continuations
must be identical with chosen-token logprobs within 1e-4.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from antumbra import Engine, SamplingParams
from antumbra.config import CSA, HCA, SLIDING, SchedulerConfig
from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

ATOL = 1e-4


@dataclass(frozen=True)
class Case:
    name: str
    spec: TinyModelSpec


CASES = [
    Case("real-rates", TinyModelSpec()),
    Case(
        "window16-rates8-32-reordered",
        TinyModelSpec(
            sliding_window=16,
            layer_types=(HCA, CSA, SLIDING, CSA, HCA),
            compress_rates={CSA: 8, HCA: 32},
            seed=1,
        ),
    ),
    Case(
        "odd-widths",
        TinyModelSpec(
            hidden_size=56,
            num_heads=3,
            head_dim=40,
            rope_dim=8,
            q_lora_rank=24,
            o_groups=3,
            o_lora_rank=12,
            index_head_dim=24,
            index_topk=5,
            n_routed_experts=5,
            num_experts_per_tok=3,
            num_mtp_layers=0,  # the release's MXFP4 experts need widths in multiples of 32
            moe_intermediate_size=20,
            sliding_window=24,
            layer_types=(CSA, SLIDING, HCA),
            mlp_layer_types=("hash_moe", "hash_moe", "moe"),
            compress_rates={CSA: 4, HCA: 16},
            seed=2,
        ),
    ),
]


def boundary_lengths(spec: TinyModelSpec) -> list[int]:
    w = spec.sliding_window
    lengths = {1, 3, 4, 5, w - 1, w, w + 1, 700}
    for rate in spec.compress_rates.values():
        lengths |= {rate - 1, rate, rate + 1, 2 * rate + 3}
    return sorted(n for n in lengths if n >= 1)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    # The comparisons here are at 1e-5: with several intra-op threads, how a matmul's reduction is
    # split can depend on what the engine's other threads (driver, text output) run at the moment.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def pair(request, tmp_path_factory) -> tuple[Case, Path, DeepseekV4ForCausalLM, Engine]:
    case: Case = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(case.name) / "model", case.spec)
    reference = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    return case, path, reference, engine


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def reference_logits(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_prompt_logits_match_at_every_boundary(pair):
    case, _, reference, engine = pair
    vocab = reference.config.vocab_size
    for length in boundary_lengths(case.spec):
        ids = random_prompt(length, vocab, seed=length)
        ours = engine.prompt_logits(ids)
        theirs = reference_logits(reference, ids)
        assert ours.shape == theirs.shape
        err = (ours - theirs).abs().max().item()
        assert err < ATOL, f"{case.name}: prompt of {length} tokens differs by {err}"
    engine.check_integrity()


def test_greedy_continuations_match(pair):
    case, _, reference, engine = pair
    vocab = reference.config.vocab_size
    w = case.spec.sliding_window
    prompts = [random_prompt(n, vocab, seed=1000 + n) for n in (5, w + 1, 300)]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        gen = reference.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        theirs = gen.sequences[0, len(ids) :].tolist()
        assert out.token_ids == theirs, (
            f"{case.name}: greedy continuation differs for a {len(ids)}-token prompt"
        )
        assert out.finish_reason == "length"
        ref_logprobs = [
            torch.log_softmax(step[0].float(), -1)[tok].item()
            for step, tok in zip(gen.logits, theirs, strict=True)
        ]
        our_logprobs = [step[tok] for step, tok in zip(out.logprobs, out.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(our_logprobs, ref_logprobs, strict=True)) < ATOL
    engine.check_integrity()


def test_chunked_prefill_gives_the_same_logits(pair):
    case, path, _, engine = pair
    vocab = engine.model_config.vocab_size
    ids = random_prompt(2 * case.spec.sliding_window + 37, vocab, seed=7)
    whole = engine.prompt_logits(ids)
    for chunk in (1, 7, 64, 128):
        chunked = Engine(
            engine.model,
            engine.tokenizer,
            _with_chunk(engine, chunk),
        )
        got = chunked.prompt_logits(ids)
        err = (got - whole).abs().max().item()
        assert err < ATOL, f"{case.name}: chunks of {chunk} differ by {err}"
        chunked.check_integrity()


def _with_chunk(engine: Engine, chunk: int):
    from dataclasses import replace

    sched = replace(engine.config.scheduler, max_prefill_chunk_tokens=chunk)
    return replace(engine.config, scheduler=sched)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worked example's 512-id model: the bound below is a float32 bound over its logits (over
    V4's 129,280 a batch of eight parts from the same prompts alone by 1.0e-5 to 1.2e-5 in a
    logprob: summation order over that many terms)."""
    from antumbra.rl.example import make_toy_checkpoint

    return make_toy_checkpoint(tmp_path_factory.mktemp("toy"))


def test_batch_equals_separate_calls(toy_checkpoint: Path) -> None:
    engine = Engine.from_pretrained(toy_checkpoint, device="cpu", dtype="float32",
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512))
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (3, 17, 64, 127, 129, 200, 256, 411)]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    together = engine.generate(prompts, params)
    engine.check_integrity()
    for prompt, out in zip(prompts, together, strict=True):
        alone = engine.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
        for a, b in zip(alone.logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert max(abs(a[k] - b[k]) for k in a) < 1e-5
    engine.check_integrity()
    engine.clear_cache()
    assert engine.pools.num_free_virtual_pages == engine.pools.layout.num_virtual_pages
