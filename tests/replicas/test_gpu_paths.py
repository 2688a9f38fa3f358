"""On a GPU: every decode path gives the CPU engine's tokens, and the release fixed-shape step agrees
with the general step as closely as two right paths can.

These run only where there is a CUDA device (`@pytest.mark.gpu`); `python -m benchmarks run
gpu-tests` runs them and records their outcomes with the tree's hash and the device. On the CPU the
same comparisons run with the kernels interpreted in the other test files of this folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.config import FastPathConfig

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = (1, 5, 129, 300, 700)
NUM_TOKENS = 32


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 261, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def release_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from antumbra.replicas.model.release_format import save_release_checkpoint
    from antumbra.replicas.model.tiny import TinyModelSpec, build_model, mtp_tensors

    # Release's FP4 indexer keys are read as two halves of index_head_dim / 2 channels each, and the
    # score kernel's dot needs 16 of them.
    spec = TinyModelSpec(seed=5, index_head_dim=32)
    model = build_model(spec)
    return save_release_checkpoint(model.state_dict(), model.config, tmp_path_factory.mktemp("release"),
                                   mtp_state_dict=mtp_tensors(spec))


@pytest.fixture(scope="module")
def cpu_engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")


GREEDY_PATHS = {
    "graphs": FastPathConfig(decode="auto"),
    "general": FastPathConfig(decode="off"),
    # The CSA indexers on a second stream inside the graphs.
    "graphs_overlap_indexer": FastPathConfig(decode="auto", overlap_indexer=True),
}


@pytest.mark.parametrize("path", sorted(GREEDY_PATHS))
def test_gpu_greedy_tokens_equal_the_cpu_engine(tiny_checkpoint: Path, cpu_engine: Engine, path: str) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in cpu_engine.generate(_prompts(), params)]
    gpu = Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="float32", fast=GREEDY_PATHS[path])
    got = [o.token_ids for o in gpu.generate(_prompts(), params)]
    gpu.check_integrity()
    assert got == want
    if path != "general":
        assert gpu.runner.fast is not None and gpu.runner.fast.num_steps > 0


def test_packed_mxfp4_experts_on_a_gpu_give_the_cpu_tokens(release_checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    cpu = Engine.from_pretrained(release_checkpoint, device="cpu", dtype="float32")
    gpu = Engine.from_pretrained(release_checkpoint, device="cuda", dtype="float32",
                                 fast=FastPathConfig(decode="auto", expert_format="mxfp4"))
    assert [o.token_ids for o in gpu.generate(_prompts(), params)] == \
        [o.token_ids for o in cpu.generate(_prompts(), params)]


SAMPLED = {
    "seeded_t1": lambda i: SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=100 + i,
                                          ignore_eos=True),
    "seeded_top_p_top_k": lambda i: SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_p=0.9,
                                                   top_k=50, seed=200 + i, ignore_eos=True),
    # Drawn and counted in the captured graphs' race (replicas/graph_race.py) on the GPU.
    "penalised": lambda i: SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9 if i % 2 else 0.0,
                                          seed=300 + i, ignore_eos=True, frequency_penalty=-0.8,
                                          presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 2.0},
                                          min_p=0.02, min_tokens=4),
}


@pytest.mark.parametrize("mode", sorted(SAMPLED))
@pytest.mark.parametrize("path", ["graphs", "general"])
def test_seeded_sampling_on_a_gpu_equals_the_cpu(tiny_checkpoint: Path, cpu_engine: Engine, mode: str,
                                                 path: str) -> None:
    prompts = _prompts()
    params = [SAMPLED[mode](i) for i in range(len(prompts))]
    want = [o.token_ids for o in cpu_engine.generate(prompts, params)]
    gpu = Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="float32", fast=GREEDY_PATHS[path])
    assert [o.token_ids for o in gpu.generate(prompts, params)] == want
    # OpenAI's default (temperature 1, no seed) simply runs.
    unseeded = gpu.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in unseeded)


def test_an_engines_first_prefill_equals_its_later_ones(tiny_checkpoint: Path) -> None:
    """In exact numerics one prompt gives one answer whatever ran before it on the engine."""
    engine = Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="bfloat16")
    prompt = _prompts()[-1]
    first = engine.prompt_logits(prompt)
    engine.generate(_prompts()[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.clear_cache()
    assert torch.equal(engine.prompt_logits(prompt), first)


def _release_greedy(checkpoint: Path, decode: str, nudge: float = 0.0) -> tuple[list[int], list[float]]:
    fast = FastPathConfig(decode=decode, expert_format="dense", linear_format="dense", general_kernels="off")
    engine = Engine.from_pretrained(checkpoint, device="cuda", dtype="float32", numerics="release", fast=fast)
    if nudge:
        with torch.no_grad():
            engine.core.model.model.embed_tokens.weight.mul_(1.0 + nudge)
    out = engine.generate([_prompts()[-1]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                            logprobs=0))[0]
    return list(out.token_ids), [step[t] for step, t in zip(out.logprobs, out.token_ids, strict=True)]


def _spread(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> tuple[int, float]:
    """Leading tokens two runs share, and their mean logprob difference over those."""
    n = next((i for i, (x, y) in enumerate(zip(a[0], b[0], strict=True)) if x != y), len(a[0]))
    diffs = [abs(x - y) for x, y in zip(a[1][:n], b[1][:n], strict=True)]
    return n, (sum(diffs) / len(diffs) if diffs else 0.0)


def test_release_fixed_step_parts_from_the_general_step_no_more_than_rounding(
        release_checkpoint: Path) -> None:
    """Release rounds activations, KV rows and indexer keys to FP8 / FP4, so two right float32 paths
    flip codes and part by far more than exact numerics' 1e-5. The measure of rounding is the general
    step against itself with its embedding table scaled by 1 + 2^-22: the fixed-shape step (its
    kernels reading the pools' codes) may part from the general step by 3x that, or 0.05 at least."""
    fixed = _release_greedy(release_checkpoint, "on")
    general = _release_greedy(release_checkpoint, "off")
    nudged = _release_greedy(release_checkpoint, "off", nudge=2.0**-22)
    agree, spread = _spread(fixed, general)
    _, rounding = _spread(nudged, general)
    assert agree >= 2
    assert spread <= max(3.0 * rounding, 0.05)


def test_constrained_rows_on_the_graphs_draw_what_the_cpu_engine_draws(tiny_checkpoint: Path,
                                                                       cpu_engine: Engine) -> None:
    """Rows under JSON schemas beside a free row, seeded: the masked draws replayed as graphs after
    the overlapped forward give the CPU engine's tokens, and the answers validate."""
    import json

    import jsonschema

    from antumbra.replicas.structured import json_schema_grammar

    pair = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3,
            "maxItems": 3}
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=300 + i, grammar=json_schema_grammar(pair))
              for i in range(3)] + [SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)]
    prompts = ["hi", "a list", "numbers", "free"]
    want = cpu_engine.generate(prompts, params)
    gpu = Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="float32", fast=GREEDY_PATHS["graphs"])
    got = gpu.generate(prompts, params)
    gpu.check_integrity()
    assert gpu.core.overlap.num_overlapped_steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got[:3]:
        jsonschema.validate(json.loads(out.text), pair)


def test_gpu_speculation_on_the_decode_graphs_gives_the_cpu_tokens(distilled_checkpoint: Path) -> None:
    """Verify steps replayed from the decode graphs (a request's k + 1 positions as rows) and the MTP
    drafter's captured step: greedy tokens equal the CPU engine's without speculation."""
    from antumbra.rl.mtp_distill import DISTILL_SPEC, random_prompts

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(4, 20, (2, DISTILL_SPEC.padded_vocab_start), 7)
    cpu = Engine.from_pretrained(distilled_checkpoint, device="cpu", dtype="float32")
    want = [o.token_ids for o in cpu.generate(prompts, params)]
    gpu = Engine.from_pretrained(distilled_checkpoint, device="cuda", dtype="float32", speculative_tokens=3,
                                 speculative_max_batch=4,
                                 fast=FastPathConfig(decode="auto"))
    graphs = gpu.runner.fast
    assert graphs is not None
    verified = []
    run_verify = graphs.run_verify
    def counted(chunks, greedy=False):  # type: ignore[no-untyped-def]
        verified.append(len(chunks))
        return run_verify(chunks, greedy)

    graphs.run_verify = counted  # type: ignore[method-assign]
    outs = gpu.generate(prompts, params)
    gpu.check_integrity()
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_accepted_tokens for o in outs) > 0 and verified
    speculation = gpu.core.runner.speculation
    assert speculation is not None
    draft_graphs = speculation.drafter.graphs  # type: ignore[attr-defined]
    assert draft_graphs.num_steps > 0
    assert draft_graphs.num_after_verify > 0  # cycles captured and launched behind their verify step


def test_batch_invariant_mode_on_the_graphs_is_bitwise_batch_invariant(release_checkpoint: Path) -> None:
    """Batch-invariant mode in bfloat16 with the packed weights and the decode graphs (every step's
    one-token chunks replayed at one padded size): a prompt's seeded tokens and logprobs are bitwise
    the same alone and among the other prompts, whose lengths put its prompt tokens and decodes in
    replays beside other requests' prompt tokens and decodes."""
    from antumbra.replicas.plan import DecodePath, ExpertFormat, LinearFormat

    engine = Engine.from_pretrained(release_checkpoint, device="cuda", dtype="bfloat16", deterministic=True)
    plan = engine.plan
    assert plan.decode is DecodePath.GRAPHS
    assert (plan.expert_format, plan.linear_format) == (ExpertFormat.MXFP4, LinearFormat.FP8)
    graphs = engine.core.runner.fast
    assert graphs is not None and len(graphs.batch_sizes) == 1
    prompts = _prompts()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=11, logprobs=3, ignore_eos=True)
    alone = engine.generate([prompts[3]], params)[0]
    replays = graphs.num_steps
    assert replays >= len(prompts[3]) + NUM_TOKENS - 1  # every token of it in the graphs
    engine.clear_cache()  # the prompt is computed again, not read from the cache
    together = engine.generate(prompts, params)[3]
    engine.check_integrity()
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # float equality: bitwise
