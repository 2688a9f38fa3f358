"""The V4-Flash slice the engine suites run: four layers (one of each attention kind, two CSA) at
V4-Flash widths with random weights in the release's formats, as transformers' model and as ours
over the same weights; prompts; greedy runs and how two of them agree."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class SliceSpec:
    """Widths of a V4-Flash slice: V4-Flash's own, with 16 routed experts and four layers."""

    hidden_size: int = 4096
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ("sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention", "compressed_sparse_attention")
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 16
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    vocab_size: int = 129280
    compress_rates: dict[str, int] = field(
        default_factory=lambda: {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    )


SMOKE_SLICE = SliceSpec(hidden_size=256, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64, o_groups=2,
                        o_lora_rank=64, index_n_heads=8, index_head_dim=32, index_topk=16, n_routed_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=1024)


# V4-Flash's own MoE on the slice's four layers: 256 routed experts + 1 shared, top-6, intermediate
# 2048; the first three layers hash-routed (the config's default `mlp_layer_types`: 3 x hash_moe,
# then moe), as V4-Flash routes its first three. `benchmarks/engine/real_moe_checkpoint.py` has the
# memory arithmetic behind four layers.
REAL_MOE_SLICE = SliceSpec(n_routed_experts=256)
# --smoke: the smoke slice's widths with 16 experts and V4's top-6.
SMOKE_REAL_MOE = replace(SMOKE_SLICE, n_routed_experts=16, num_experts_per_tok=6)


def hf_config(spec: SliceSpec, mtp_layers: int = 0) -> Any:
    """`mtp_layers`: the config's `num_nextn_predict_layers` (transformers builds no MTP block either way)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(  # type: ignore[call-arg]
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=len(spec.layer_types),
        layer_types=list(spec.layer_types),
        compress_rates=dict(spec.compress_rates),
        num_attention_heads=spec.num_heads,
        num_key_value_heads=1,
        head_dim=spec.head_dim,
        partial_rotary_factor=spec.rope_dim / spec.head_dim,
        q_lora_rank=spec.q_lora_rank,
        o_groups=spec.o_groups,
        o_lora_rank=spec.o_lora_rank,
        sliding_window=spec.sliding_window,
        index_n_heads=spec.index_n_heads,
        index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        max_position_embeddings=131072,
        num_nextn_predict_layers=mtp_layers,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )


# ---------------------------------------------------------------- random weights, drawn on the device


def draw(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str | torch.device,
         num_experts: int) -> torch.Tensor:
    """A value for in-memory tensor `name` the way the tiny checkpoints draw it (fan-in linears, norms
    near 1, `tid2eid` rows of distinct experts), float32 (int64 for `tid2eid`) on `device`."""
    leaf = name.rsplit(".", 1)[-1]

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std + mean

    if leaf == "tid2eid":
        order = torch.rand((shape[0], num_experts), generator=gen, device=device).argsort(dim=1)
        return order[:, : shape[1]]
    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(4.0 / math.sqrt(shape[-1]))
    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if leaf in ("sinks", "position_bias", "base", "hc_base"):
        return normal(0.5)
    if leaf in ("scale", "hc_scale"):
        return 0.5 + torch.rand(shape, generator=gen, device=device)
    if leaf == "e_score_correction_bias":
        return normal(0.1)
    return normal(1.0 / math.sqrt(shape[-1]))


@torch.no_grad()
def randomize_(model: torch.nn.Module, num_experts: int, seed: int = 0) -> None:
    """Redraw every tensor the way the tiny checkpoints do (`draw`), on its device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        t.copy_(draw(name, tuple(t.shape), gen, t.device, num_experts).to(t.dtype))


@torch.no_grad()
def random_mtp_block(config: Any, num_experts: int, device: str, seed: int) -> Any:
    """An `MTPBlock` of the transformers config `config`, float32 on `device`, drawn as the target's
    tensors are (`draw`) from a generator of its own (`seed`), so the target's weights do not depend
    on it."""
    from antumbra.config import ModelConfig
    from antumbra.replicas.model.mtp import MTPBlock

    with torch.device(device):
        block = MTPBlock(ModelConfig.from_hf(config))
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in block.state_dict(keep_vars=True).items():
        t.copy_(draw(name, tuple(t.shape), gen, device, num_experts).to(t.dtype))
    return block


@torch.no_grad()
def make_experts_mxfp4_(model: torch.nn.Module) -> None:
    """Round every routed expert through MXFP4, so packing them later is lossless."""
    from antumbra.replicas.model.quant import quant_mxfp4, unpack_mxfp4

    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for e in range(p.shape[0]):
                p[e].copy_(unpack_mxfp4(*quant_mxfp4(p[e])).to(p.dtype))


@torch.no_grad()
def make_linears_fp8_(model: torch.nn.Module) -> int:
    """Round the linears the release stores in FP8 through its 128 x 128 block format."""
    from antumbra.replicas.model.fp8_linear import FP8_LINEARS
    from antumbra.replicas.model.quant import dequant_fp8_block, quant_fp8_block

    count = 0
    for name, module in model.named_modules():
        for child in FP8_LINEARS.get(name.rsplit(".", 1)[-1], ()):
            linear = getattr(module, child, None)
            if isinstance(linear, torch.nn.Linear):
                linear.weight.copy_(dequant_fp8_block(*quant_fp8_block(linear.weight)).to(linear.weight.dtype))
                count += 1
    return count


def build_hf(spec: SliceSpec, device: str, dtype: torch.dtype, mtp_layers: int = 0) -> Any:
    """transformers' model with weights in the release's formats: FP8-block linears, MXFP4 experts
    (stored dequantised in `dtype`, which holds those values exactly); its config names `mtp_layers`
    MTP blocks, whose weights it does not hold (`random_mtp_block`)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device(device):
        model = DeepseekV4ForCausalLM(hf_config(spec, mtp_layers)).to(dtype)
    randomize_(model, spec.n_routed_experts)
    make_experts_mxfp4_(model)
    make_linears_fp8_(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_engine(hf_model: Any, device: str, dtype: str, max_model_len: int, max_num_seqs: int,
                 num_virtual_tokens: int, graphs: bool = True, deterministic: bool = False,
                 numerics: str = "exact", hisparse_rows: int | None = None, decode: str = "auto",
                 warmup: str = "auto", capture_at_start: bool = True, dense: bool = False,
                 general_kernels: str = "auto", tokenizer: Any = None, prefill_rows: int = 0) -> Any:
    """Our engine over a copy of the transformers model's weights, kept packed on the device in the
    release's formats (MXFP4 experts, FP8 linears), in batch-invariant mode (`deterministic`) too.
    The weights are release-rounded, so the engine is told the checkpoint is release-layout: in
    `release` numerics "auto" then takes the packed formats and the fixed-shape decode step with
    CUDA graphs (FP8 / FP4 pools read as codes). `dense` keeps every weight in the model dtype (the
    packed values, exactly). `prefill_rows`: `FastPathConfig.prefill_rows` (graphs up to 256 rows)."""
    from antumbra import Engine
    from antumbra.config import CacheConfig, EngineConfig, FastPathConfig, ModelConfig, SchedulerConfig
    from antumbra.replicas.build import param_dtype
    from antumbra.replicas.model.model import DeepseekV4
    from antumbra.replicas.plan import resolve_dtype

    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = DeepseekV4(ModelConfig.from_hf(hf_model.config))
    source = hf_model.state_dict()
    state = {name: source[name].to(device=device, dtype=param_dtype(name, t, torch_dtype), copy=True)
             for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    config = EngineConfig(
        device=device,
        dtype=dtype,
        numerics=numerics,
        cache=CacheConfig(num_virtual_tokens=num_virtual_tokens, hisparse_rows_per_request=hisparse_rows),
        # The engine's default step budget for the device (`AUTO_TOKEN_BUDGET`); the engine suite
        # also times the 16K prefill at another.
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len).with_token_budget(
            torch.device(device).type),
        fast=FastPathConfig(
            # Release numerics resolve "auto" to the packed formats for a release-layout checkpoint.
            expert_format="dense" if dense else "auto" if numerics != "exact" else "mxfp4",
            linear_format="dense" if dense else "auto" if numerics != "exact" else "fp8",
            general_kernels=general_kernels,
            cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64) + ((96, 128, 192, 256) if prefill_rows else ()),
            prefill_rows=prefill_rows,
            cuda_graphs=graphs,
            capture_at_start=capture_at_start,
            decode=decode,
        ),
        deterministic=deterministic,
        warmup=warmup,
    )
    return Engine(model, tokenizer, config, checkpoint_layout="release")


# ---------------------------------------------------------------- timing



def prompts(vocab: int, batch: int, ctx: int, seed: int, shared: int = 0) -> list[list[int]]:
    """`batch` prompts of `ctx` random tokens sharing their first `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(2, vocab, (ctx - shared,), generator=g).tolist() for _ in range(batch)]


def free_engine(engine: Any) -> None:
    """Drop an engine and give its device memory back before the next one is built."""
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


AGREE_TOKENS = 16


def greedy_with_logprobs(engine: Any, prompt: list[int],
                         tokens: int = AGREE_TOKENS) -> tuple[list[int], list[float]]:
    """`tokens` greedy tokens after `prompt` (nothing cached) and each one's logprob."""
    from antumbra import SamplingParams

    engine.clear_cache()
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = engine.generate([prompt], params)[0]
    return list(out.token_ids), [step[t] for step, t in zip(out.logprobs, out.token_ids, strict=True)]


def agreement(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> dict[str, Any]:
    """Leading greedy tokens two paths agree on, and the largest logprob difference over them. The
    check passes when the first 4 agree and their logprobs are within 0.05 (bf16 paths that order
    their sums differently may part at a near-tie later)."""
    agree = 0
    for a, b in zip(ours[0], theirs[0], strict=True):
        if a != b:
            break
        agree += 1
    diff = max((abs(x - y) for x, y in zip(ours[1][:agree], theirs[1][:agree], strict=True)), default=0.0)
    return {"leading_tokens_agree": agree, "of": len(ours[0]), "max_logprob_diff": diff,
            "ok": agree >= 4 and diff < 0.05}
