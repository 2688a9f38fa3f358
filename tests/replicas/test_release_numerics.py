"""Release numerics: the quantisation primitives against plain re-derivations of their definitions, and
the engine in `release` mode against transformers' DeepSeek-V4 with the same round trips hooked in at
the same points (fp32, CPU).

The hooked reference applies, independently of the engine's code:
* an FP8 round trip (block 64) to the non-RoPE channels of `self_attn.kv_norm` and of the main
  compressor's `kv_norm` outputs (RoPE only touches the trailing channels, so this commutes with it);
* a Hadamard rotation (an explicit matrix) plus an FP4 round trip (block 32) to the indexer scorer's
  queries and keys (both after RoPE);
* an FP8 round trip (block 128) to the inputs of q_a / q_b / kv / o_b, indexer q_b and the shared
  expert's projections, and routed experts recomputed pair by pair with the routing weight applied to
  the down projection's input before its round trip.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV4ForCausalLM

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, EngineConfig, SchedulerConfig
from antumbra.replicas.model.numerics import EXACT, RELEASE, Numerics
from antumbra.replicas.model.quant import fp4_roundtrip, fp8_roundtrip, hadamard_rotate

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_FLOOR = 1e-4  # smallest block amax the release kernels use when picking a scale
FP4_FLOOR = 6.0 * 2.0**-126
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index parity = mantissa bit

# --------------------------------------------------------------------- independent references


def ref_pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """2^ceil(log2(max(amax, floor) * (1/qmax))), the product rounded to float32 as the release kernels do."""
    product = amax.float().clamp(min=floor) * torch.tensor(1.0 / qmax, dtype=torch.float32)
    return torch.exp2(torch.ceil(torch.log2(product.double()))).float()


def ref_blockwise(x: torch.Tensor, block: int, round_block) -> torch.Tensor:
    """Apply `round_block` to each run of `block` channels of the last dim (the last run may be short)."""
    x32 = x.float()
    parts = [round_block(x32[..., c0 : c0 + block]) for c0 in range(0, x.shape[-1], block)]
    return torch.cat(parts, dim=-1).to(x.dtype) if parts else x


def ref_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    def one(b: torch.Tensor) -> torch.Tensor:
        s = ref_pow2_scale(b.abs().amax(-1, keepdim=True), E4M3_MAX, FP8_FLOOR)
        return (b / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s

    return ref_blockwise(x, block, one)


def ref_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value by exhaustive search over the 8 magnitudes; a tie goes to the even code."""
    grid = torch.tensor(E2M1_MAGNITUDES)
    mag = v.abs().clamp(max=E2M1_MAX)
    dist = (mag[..., None] - grid).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    even = (torch.arange(8) % 2 == 0) & nearest
    pick = torch.where(even.any(-1, keepdim=True), even, nearest).float().argmax(-1)
    return grid[pick] * torch.where(v < 0, -1.0, 1.0)


def ref_fp4(x: torch.Tensor, block: int) -> torch.Tensor:
    def one(b: torch.Tensor) -> torch.Tensor:
        s = ref_pow2_scale(b.abs().amax(-1, keepdim=True), E2M1_MAX, FP4_FLOOR)
        return ref_e2m1(b / s) * s

    return ref_blockwise(x, block, one)


def ref_hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester construction H_2k = [[H_k, H_k], [H_k, -H_k]], normalised by 1/sqrt(n); float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def ref_indexer(x: torch.Tensor) -> torch.Tensor:
    rotated = (x.double() @ ref_hadamard_matrix(x.shape[-1])).to(x.dtype)
    return ref_fp4(rotated, 32)


def sample(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values with a wide spread of magnitudes across channels, some runs all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])
    if shape[-1] >= 40:
        x[..., 3:40] = 0.0
    return x


# --------------------------------------------------------------------------- primitives


@pytest.mark.parametrize("shape", [(3, 5, 100), (7, 64), (2, 1), (4, 300), (1, 129)])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_fp8_roundtrip_matches_definition(shape, block) -> None:
    x = sample(shape, seed=sum(shape) + block)
    got = fp8_roundtrip(x, block)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, ref_fp8(x, block))
    assert torch.equal(fp8_roundtrip(x.bfloat16(), block), ref_fp8(x.bfloat16(), block))


def test_fp8_roundtrip_zero_tiny_and_saturating_blocks() -> None:
    x = torch.zeros(3, 128)
    # Below the amax floor the scale is 2^ceil(log2(1e-4 / 448)) = 2^-22, so 3e-6 = 12.58 * 2^-22
    # rounds to 13 * 2^-22 (its own amax would have given a finer scale).
    x[1, :64] = 3e-6
    x[2, :64] = torch.linspace(-448.0 * 4, 448.0 * 4, 64)  # the ends are e4m3 values times 4: exact
    got = fp8_roundtrip(x, 64)
    assert torch.equal(got[0], x[0]) and torch.equal(got[:, 64:], x[:, 64:])
    assert torch.equal(got, ref_fp8(x, 64))
    assert got[2, 0] == -448.0 * 4 and got[2, 63] == 448.0 * 4
    assert torch.all(got[1, :64] == 13 * 2.0**-22)


@pytest.mark.parametrize("shape", [(3, 5, 96), (7, 16), (2, 1), (4, 300), (1, 33)])
def test_fp4_roundtrip_matches_definition(shape) -> None:
    x = sample(shape, seed=sum(shape))
    got = fp4_roundtrip(x, 32)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, ref_fp4(x, 32))
    assert torch.equal(fp4_roundtrip(x.bfloat16(), 32), ref_fp4(x.bfloat16(), 32))


def test_fp4_roundtrip_ties_go_to_even_codes() -> None:
    # A block whose max is 6 has scale 1, so its values round on the bare e2m1 grid. Midpoints between
    # neighbouring codes go to the one with mantissa bit 0: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    # 2.5->2, 3.5->4, 5->4; anything past 6 saturates.
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, 0.3, 0.0] + [0.0] * 20])
    got = fp4_roundtrip(x, 32)
    want = torch.tensor([[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 0.5, 0.0] + [0.0] * 20])
    assert torch.equal(got, want)
    assert torch.equal(got, ref_fp4(x, 32))
    zero = torch.zeros(2, 32)
    assert torch.equal(fp4_roundtrip(zero, 32), zero)


@pytest.mark.parametrize("n", [1, 2, 4, 16, 32, 128, 256])
def test_hadamard_is_the_normalised_sylvester_matrix(n) -> None:
    h = ref_hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hadamard_rotate(torch.eye(n, dtype=torch.float64)), h, atol=1e-12)
    x = sample((3, 2, n), seed=n)
    got = hadamard_rotate(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.allclose(got.double(), x.double() @ h, rtol=1e-5, atol=1e-5 * x.abs().max().item())
    # Orthonormal: inner products survive the rotation.
    y = sample((3, 2, n), seed=n + 1)
    dots = (hadamard_rotate(x.double()) * hadamard_rotate(y.double())).sum(-1)
    assert torch.allclose(dots, (x.double() * y.double()).sum(-1), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n", [3, 24, 0])
def test_hadamard_rejects_other_widths(n) -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.zeros(2, n))


def test_numerics_modes_and_config_validation() -> None:
    assert Numerics.of("exact") == EXACT and Numerics.of("release") == RELEASE
    assert RELEASE.kv_fp8 and RELEASE.indexer_fp4 and RELEASE.act_fp8
    x = sample((4, 32), seed=0)
    assert EXACT.act(x) is x and EXACT.kv(x, 8) is x and EXACT.indexer(x) is x
    kv = RELEASE.kv(x, 8)
    assert torch.equal(kv[:, -8:], x[:, -8:]) and torch.equal(kv[:, :-8], ref_fp8(x[:, :-8], 64))
    assert torch.equal(RELEASE.indexer(x), ref_indexer(x))
    with pytest.raises(ValueError):
        Numerics.of("fp8")
    with pytest.raises(ValueError):
        EngineConfig(numerics="fast")
    assert EngineConfig().numerics == "exact"


def test_release_numerics_need_a_power_of_two_indexer_width() -> None:
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.model import DeepseekV4
    from antumbra.replicas.model.tiny import TinyModelSpec, build_config

    with torch.device("meta"):
        model = DeepseekV4(ModelConfig.from_hf(build_config(TinyModelSpec(index_head_dim=24))))
    model.set_numerics(replace(RELEASE, indexer_fp4=False))
    with pytest.raises(ValueError, match="power-of-two"):
        model.set_numerics(RELEASE)
    assert model.numerics == replace(RELEASE, indexer_fp4=False)


# --------------------------------------------------------------------------- hooked reference


def _round_nope(rope_dim: int):
    def hook(module, inputs, output):
        nope = output.shape[-1] - rope_dim
        return torch.cat([ref_fp8(output[..., :nope], 64), output[..., nope:]], dim=-1)

    return hook


def _round_input(module, args):
    return (ref_fp8(args[0], 128), *args[1:])


def _rotate_scorer_inputs(module, args):
    q, keys, hidden = args
    return ref_indexer(q), ref_indexer(keys), hidden


def _release_experts(experts, hidden_states, top_k_index, top_k_weights):
    """Routed experts pair by pair: FP8 input, SwiGLU, routing weight, FP8 again, down projection."""
    x = ref_fp8(hidden_states, 128)
    out = torch.zeros_like(hidden_states)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            gate, up = F.linear(x[t], experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.silu(gate.clamp(max=experts.limit)) * up.clamp(-experts.limit, experts.limit)
            out[t] += F.linear(ref_fp8(h * top_k_weights[t, j], 128), experts.down_proj[e])
    return out


@contextmanager
def release_hooks(model: DeepseekV4ForCausalLM, numerics: Numerics = RELEASE) -> Iterator[None]:
    rope_dim = int(model.config.head_dim * model.config.partial_rotary_factor)
    handles = []
    patched = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        comp = attn.compressor
        indexer = getattr(comp, "indexer", None)
        if numerics.kv_fp8:
            for norm in [attn.kv_norm] + ([comp.kv_norm] if comp is not None else []):
                handles.append(norm.register_forward_hook(_round_nope(rope_dim)))
        if numerics.indexer_fp4 and indexer is not None:
            handles.append(indexer.scorer.register_forward_pre_hook(_rotate_scorer_inputs))
        if numerics.act_fp8:
            linears = [attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj]
            linears += [
                mlp.shared_experts.gate_proj,
                mlp.shared_experts.up_proj,
                mlp.shared_experts.down_proj,
            ]
            linears += [indexer.q_b_proj] if indexer is not None else []
            handles += [lin.register_forward_pre_hook(_round_input) for lin in linears]
            experts = mlp.experts
            experts.forward = lambda h, i, w, experts=experts: _release_experts(experts, h, i, w)
            patched.append(experts)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in patched:
            del module.forward


# --------------------------------------------------------------------------- end to end
#
# Release numerics are discontinuous. The engine and the reference (or a chunked and a one-shot forward)
# run their float ops in different orders, so a value now and then sits within an ulp of an FP8 rounding
# boundary and rounds the other way in one of them; on a random tiny model that step can flip an FP4
# indexer code and then a top-k choice, which moves every later logit of that prompt by O(1). Agreement
# is therefore judged over many prompts: enough of them must agree at every position, and most positions
# must come before their prompt's first disagreement. Without any one of the quantisations no prompt
# agrees and almost no position does (the indexer's only matters once a query has more than
# `index_topk` entries, hence a short agreeing prefix there).

AGREE_TOL = 1e-3  # per position: max |logit difference| over the vocabulary
LENGTHS = tuple(range(140, 361, 20))  # past the window, the first HCA entry and `index_topk` CSA entries
MIN_CLEAN_PROMPTS = 1 / 3
MIN_AGREEING_POSITIONS = 1 / 2
EXACT_TOL = 1e-4  # exact mode against plain transformers, as in test_model_vs_transformers


@dataclass(frozen=True)
class Agreement:
    clean_prompts: float  # fraction of prompts within AGREE_TOL at every position
    agreeing_positions: float  # fraction of positions before their prompt's first disagreement
    worst: float  # largest per-position error

    @staticmethod
    def of(errors: list[torch.Tensor]) -> Agreement:
        """errors: per prompt, [S] max |logit difference| of each position."""
        prefixes = [
            int((e > AGREE_TOL).nonzero()[0]) if bool((e > AGREE_TOL).any()) else len(e) for e in errors
        ]
        return Agreement(
            clean_prompts=sum(n == len(e) for n, e in zip(prefixes, errors, strict=True)) / len(errors),
            agreeing_positions=sum(prefixes) / sum(len(e) for e in errors),
            worst=max(e.max().item() for e in errors),
        )

    def agrees(self) -> bool:
        return self.clean_prompts >= MIN_CLEAN_PROMPTS and self.agreeing_positions >= MIN_AGREEING_POSITIONS

    def disagrees(self) -> bool:
        return self.clean_prompts == 0 and self.agreeing_positions < MIN_AGREEING_POSITIONS / 2


def position_errors(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> list[torch.Tensor]:
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    return [(a - b).abs().amax(dim=-1) for a, b in zip(ours, theirs, strict=True)]


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 512, (length,), generator=g).tolist()


PROMPTS = [prompt(n, seed=1000 + n) for n in LENGTHS]


def release_engine(path: Path, numerics: Numerics = RELEASE, **kwargs) -> Engine:
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", numerics="release", **kwargs)
    assert engine.config.numerics == "release" and engine.model.numerics == RELEASE
    engine.model.set_numerics(numerics)  # an ablation, or RELEASE again
    return engine


def engine_logits(engine: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [engine.prompt_logits(ids) for ids in prompts]


@torch.no_grad()
def reference_logits(
    model: DeepseekV4ForCausalLM, prompts: list[list[int]], numerics: Numerics | None
) -> list[torch.Tensor]:
    if numerics is None:
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts]
    with release_hooks(model, numerics):
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hooked_reference_logits(reference) -> list[torch.Tensor]:
    return reference_logits(reference, PROMPTS, RELEASE)


@pytest.fixture(scope="module")
def release_logits(tiny_checkpoint) -> list[torch.Tensor]:
    return engine_logits(release_engine(tiny_checkpoint), PROMPTS)


def test_release_engine_agrees_with_hooked_reference(release_logits, hooked_reference_logits) -> None:
    agreement = Agreement.of(position_errors(release_logits, hooked_reference_logits))
    assert agreement.agrees(), agreement


@pytest.mark.parametrize("missing", ["kv_fp8", "indexer_fp4", "act_fp8"])
def test_without_any_one_quantisation_the_engine_disagrees(
    tiny_checkpoint, hooked_reference_logits, missing
) -> None:
    # Switching numerics on a built engine needs pools that store values, not one mode's codes.
    unpacked = CacheConfig(kv_storage="model_dtype")
    ablated = release_engine(tiny_checkpoint, replace(RELEASE, **{missing: False}), cache=unpacked)
    few = len(PROMPTS) // 3
    agreement = Agreement.of(
        position_errors(engine_logits(ablated, PROMPTS[:few]), hooked_reference_logits[:few])
    )
    assert agreement.disagrees(), (missing, agreement)


def test_release_differs_from_exact_and_exact_matches_transformers(
    tiny_checkpoint, reference, release_logits
) -> None:
    exact = Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="float32")
    assert exact.model.numerics == EXACT
    few = len(PROMPTS) // 3
    exact_logits = engine_logits(exact, PROMPTS[:few])
    plain = reference_logits(reference, PROMPTS[:few], None)
    assert max(e.max().item() for e in position_errors(exact_logits, plain)) < EXACT_TOL
    agreement = Agreement.of(position_errors(release_logits[:few], exact_logits))
    assert agreement.disagrees(), agreement


@pytest.mark.parametrize("chunk", [7, 64])  # below and above the length that takes the decode attention path
def test_release_chunked_prefill_agrees_with_one_shot(tiny_checkpoint, release_logits, chunk) -> None:
    engine = release_engine(tiny_checkpoint, scheduler=SchedulerConfig(max_prefill_chunk_tokens=chunk))
    agreement = Agreement.of(position_errors(engine_logits(engine, PROMPTS), release_logits))
    assert agreement.agrees(), (chunk, agreement)


def test_release_decode_agrees_with_one_shot(tiny_checkpoint) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = release_engine(tiny_checkpoint).generate(PROMPTS, params)
    one_shot = release_engine(tiny_checkpoint)
    errors = []
    for ids, out in zip(PROMPTS, outs, strict=True):
        full = torch.log_softmax(one_shot.prompt_logits(ids + out.token_ids)[len(ids) - 1 : -1], dim=-1)
        chosen = full.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        decoded = torch.tensor([step[token] for step, token in zip(out.logprobs, out.token_ids, strict=True)])
        errors.append((decoded - chosen).abs())
        if bool(errors[-1].max() <= AGREE_TOL):
            assert out.token_ids == full.argmax(-1).tolist()
    agreement = Agreement.of(errors)
    assert agreement.agrees(), agreement
