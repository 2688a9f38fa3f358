"""Frozen configuration dataclasses passed explicitly down the stack.

`ModelConfig` is the engine's view of a DeepSeek-V4 checkpoint's `config.json`
(read through `transformers.DeepseekV4Config` at the file edge). Every size and
rate the model and the pools use comes from here; nothing below hard-codes a
window, a compression rate or a head width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
SCORE_MOE = "moe"


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: default RoPE, or YaRN when `yarn_factor` is set."""

    theta: float
    rope_dim: int  # number of rotated channels (the trailing slice of a head)
    yarn_factor: float | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_max_position: int = 0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int] = field(hash=False)
    main_rope: RopeConfig
    compress_rope: RopeConfig
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_mtp_layers: int = 0

    def compress_rate(self, layer: int) -> int:
        """Compression rate of `layer`, 0 for sliding-only layers."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def csa_rate(self) -> int:
        return self.compress_rates.get(CSA, 0)

    @property
    def hca_rate(self) -> int:
        return self.compress_rates.get(HCA, 0)

    @property
    def max_compress_rate(self) -> int:
        used = [self.compress_rate(i) for i in range(self.num_layers)]
        return max([r for r in used if r] or [1])

    @property
    def page_size(self) -> int:
        """Token page size: a multiple of every rate in use and at least the window.

        Every compressed entry then starts and ends inside one page, and a prefix
        match at a page boundary never ends inside a compression window.
        """
        lcm = 1
        for i in range(self.num_layers):
            r = self.compress_rate(i)
            if r:
                lcm = math.lcm(lcm, r)
        return lcm * math.ceil(self.sliding_window / lcm)

    @staticmethod
    def from_hf(hf: Any) -> ModelConfig:
        """Build from a `transformers.DeepseekV4Config` (or anything with its attributes)."""
        rope_dim = int(hf.head_dim * hf.partial_rotary_factor)
        params = hf.rope_parameters
        main = RopeConfig(theta=float(params["main"]["rope_theta"]), rope_dim=rope_dim)
        comp = params["compress"]
        if comp.get("rope_type", "default") == "yarn":
            original = comp.get("original_max_position_embeddings") or hf.max_position_embeddings
            factor = comp.get("factor") or hf.max_position_embeddings / original
            compress = RopeConfig(
                theta=float(comp["rope_theta"]),
                rope_dim=rope_dim,
                yarn_factor=float(factor),
                yarn_beta_fast=float(comp.get("beta_fast") or 32),
                yarn_beta_slow=float(comp.get("beta_slow") or 1),
                yarn_original_max_position=int(original),
                attention_factor=float(comp.get("attention_factor") or 1.0),
            )
        elif comp.get("rope_type", "default") == "default":
            compress = RopeConfig(theta=float(comp["rope_theta"]), rope_dim=rope_dim)
        else:
            raise ValueError(f"unsupported compress rope_type {comp.get('rope_type')!r}")
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        return ModelConfig(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            head_dim=hf.head_dim,
            rope_dim=rope_dim,
            q_lora_rank=hf.q_lora_rank,
            o_groups=hf.o_groups,
            o_lora_rank=hf.o_lora_rank,
            sliding_window=hf.sliding_window,
            layer_types=tuple(hf.layer_types),
            mlp_layer_types=tuple(hf.mlp_layer_types),
            compress_rates=dict(hf.compress_rates),
            main_rope=main,
            compress_rope=compress,
            index_n_heads=hf.index_n_heads,
            index_head_dim=hf.index_head_dim,
            index_topk=hf.index_topk,
            hc_mult=hf.hc_mult,
            hc_sinkhorn_iters=hf.hc_sinkhorn_iters,
            hc_eps=float(hf.hc_eps),
            num_experts=hf.n_routed_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            scoring_func=hf.scoring_func,
            routed_scaling_factor=float(hf.routed_scaling_factor),
            swiglu_limit=float(hf.swiglu_limit),
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=hf.max_position_embeddings,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=eos_ids,
            num_mtp_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Pool capacities in pages of `ModelConfig.page_size` tokens.

    `num_virtual_pages` bounds the tokens all live (and later cached) sequences can
    hold; `num_swa_pages` bounds the SWA rows (and the compression-state rows that
    live in them). None derives a size from the scheduler's limits.
    """

    num_virtual_tokens: int = 131072
    num_swa_pages: int | None = None
    enable_prefix_caching: bool = True
    enable_swa_replay: bool = True
    # HiSparse: CSA compressed rows on a host tier, this many device rows per request and CSA layer.
    hisparse_rows_per_request: int | None = None
    # When set, `num_virtual_tokens` is derived: as many as the device-resident pools fit in this budget.
    device_budget_bytes: int | None = None
    # How KV rows and indexer keys are stored: "auto" keeps the codes the numerics mode rounds to
    # (release: FP8 KV with UE8M0 scales, FP4 indexer keys; exact: the model dtype); "model_dtype"
    # stores the same values unpacked in the model dtype (same results, more bytes per token).
    kv_storage: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_storage not in ("auto", "model_dtype"):
            raise ValueError(f"kv_storage must be 'auto' or 'model_dtype', got {self.kv_storage!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget of one step, prefill chunks included. None: `AUTO_TOKEN_BUDGET` of the engine's
    # device type, resolved once when the engine is built (`with_token_budget`).
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # defaults to min(max_position_embeddings, virtual capacity)
    max_prefill_chunk_tokens: int | None = None  # cap on one request's prefill chunk per step
    # The order requests are served in (replicas/scheduling_policy.py): "fair_share" across tenants
    # (virtual token counters), or "fifo" (arrival order, for comparison).
    policy: str = "fair_share"
    # Inter-token latency a step with decodes should keep to: the prefill tokens beside its decodes
    # are bounded by a cost per token learned from measured steps (replicas/prefill_budget.py), never
    # below `itl_floor_tokens`, and not at all where even that many would not keep the step within
    # the budget. None: prefills take what the token budget leaves.
    itl_budget_ms: float | None = None
    itl_floor_tokens: int = 256

    @property
    def token_budget(self) -> int:
        """The resolved `max_num_batched_tokens`."""
        if self.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is unresolved: build the engine through "
                             "Engine.from_pretrained, or call with_token_budget(device_type)")
        return self.max_num_batched_tokens

    def with_token_budget(self, device_type: str) -> SchedulerConfig:
        """This config with an unset token budget resolved for `device_type` ("cuda", "cpu")."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = AUTO_TOKEN_BUDGET.get(device_type, AUTO_TOKEN_BUDGET["cpu"])
        return dataclasses.replace(self, max_num_batched_tokens=budget)


# Default step token budgets. On a GPU a prefill step of 8192 tokens keeps the GEMMs large and the
# host's share of a step small (docs/performance.md compares the prefill in 8192- and 2048-token
# steps against the FLOP floor), at the price of
# longer steps for the decodes that share them, as vLLM's and SGLang's GPU defaults do. The CPU
# keeps small steps (the interpreter's kernels and the test suite's timing).
AUTO_TOKEN_BUDGET = {"cuda": 8192, "cpu": 2048}


@dataclass(frozen=True)
class FastPathConfig:
    """The fixed-shape decode path: Triton kernels, every index built on the device, and on
    CUDA devices one captured graph per batch size (padded rows write scratch rows)."""

    decode: str = "auto"  # "auto": on for CUDA devices; "on"; "off"
    # The general step (prefill chunks, mixed batches) through the same kernels: "auto" on CUDA.
    general_kernels: str = "auto"
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
    cuda_graphs: bool = True  # False runs the same fixed-shape steps eagerly (debugging, profiling)
    capture_at_start: bool = True  # capture every batch size when the engine starts, not on first use
    # CSA indexers on a second stream beside the main query / key / compressor work (CUDA only).
    # Off: the engine suite times both (`engine_overlap_indexer_gain_*`), within a few percent either way.
    overlap_indexer: bool = False
    # Pure-decode steps of plain rows are launched before the last one's tokens are read back, so
    # the host's scheduling overlaps the device's step (replicas/overlap.py); outputs lag one step.
    overlap_schedule: bool = True
    # A step of decode rows beside prefill chunks runs its decode rows on the fixed-shape step (its
    # graphs) and only the chunks on the general one (replicas/runner.py); False: all on the general.
    mixed_steps: bool = True
    # Prompt tokens a step beside its decodes may run as rows of the fixed-shape step, each a decode
    # at its own position (as a verify chunk's drafts are): a step whose prompt chunks hold at most
    # this many tokens runs whole on the decode graphs, whose largest then holds max_num_seqs + this
    # many rows. 0: prompt chunks always run on the general step. With `itl_budget_ms` the scheduler
    # bounds such steps by their own measured cost (replicas/prefill_budget.py).
    prefill_rows: int = 0
    # Routed experts on the device: "mxfp4" packs them (e2m1 + UE8M0, read by the MoE kernel),
    # "dense" keeps the model dtype; "auto" packs on CUDA when the checkpoint stores MXFP4.
    expert_format: str = "auto"
    # Attention, indexer and shared-expert linears: "fp8" keeps the release's FP8 blocks (e4m3 +
    # UE8M0 per 128 x 128), "dense" the model dtype; "auto" keeps FP8 on CUDA when the checkpoint has it.
    linear_format: str = "auto"
    # The sampler's Gumbel race: "triton" (the kernel), "torch" (its reference); "auto": the kernel on CUDA.
    sampler: str = "auto"

    def __post_init__(self) -> None:
        if self.decode not in ("auto", "on", "off"):
            raise ValueError(f"fast decode must be auto, on or off, got {self.decode!r}")
        if self.general_kernels not in ("auto", "on", "off"):
            raise ValueError(f"general_kernels must be auto, on or off, got {self.general_kernels!r}")
        if self.expert_format not in ("auto", "dense", "mxfp4"):
            raise ValueError(f"expert_format must be auto, dense or mxfp4, got {self.expert_format!r}")
        if self.linear_format not in ("auto", "dense", "fp8"):
            raise ValueError(f"linear_format must be auto, dense or fp8, got {self.linear_format!r}")
        if self.sampler not in ("auto", "triton", "torch"):
            raise ValueError(f"sampler must be auto, triton or torch, got {self.sampler!r}")
        if not self.cuda_graph_batch_sizes or min(self.cuda_graph_batch_sizes) < 1:
            raise ValueError("cuda_graph_batch_sizes must be positive batch sizes")
        if self.prefill_rows < 0:
            raise ValueError(f"prefill_rows must be >= 0, got {self.prefill_rows}")


MAX_SPECULATIVE_TOKENS = 8


DEFAULT_SPECULATIVE_MAX_BATCH = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with the checkpoint's MTP block.

    `tokens`: drafts per step (0: off). `max_batch`: speculation pauses while more requests decode
    than this; verifying k + 1 positions per request costs compute that only pays back while decode
    is bound by reading the weights, which stops as the batch grows. `token_map`: a JSON file of the
    token ids the drafter scores (`speculative/draft_vocab.py`; None: the whole vocabulary). `gate`:
    "fixed" speculates at up to `max_batch` decodes; "measured" also only where this engine measured
    speculating steps faster per token than plain ones at that batch (`replicas/speculation_gate.py`).
    The default `max_batch` is the threshold the `spec_decode` benchmark measures on the GPU
    (`speculative_max_batch_measured` in `benchmarks/results/engine.json`): the largest batch at which
    speculating ran faster than plain decoding there. A model whose draft block is a smaller share of
    its step than the benchmark slice's may raise it."""

    tokens: int = 0
    max_batch: int = DEFAULT_SPECULATIVE_MAX_BATCH
    token_map: str | None = None
    gate: str = "fixed"

    def __post_init__(self) -> None:
        if not 0 <= self.tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.tokens!r}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be at least 1, got {self.max_batch!r}")
        if self.gate not in ("fixed", "measured"):
            raise ValueError(f"speculative gate must be 'fixed' or 'measured', got {self.gate!r}")

    def draft_pages(self, page_size: int) -> int:
        """Pages a speculating sequence may hold past its steady SWA footprint between steps: those
        its last verify chunk attached for drafts it then rejected."""
        return -(-self.tokens // page_size)


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fast: FastPathConfig = field(default_factory=FastPathConfig)
    seed: int = 0
    # "exact": transformers' arithmetic; "release": the release's FP8 KV / FP4 indexer / FP8 activation
    # round trips (antumbra/replicas/model/numerics.py). The engine applies it to its model.
    numerics: str = "exact"
    # Warm every kernel variant and decode graph up to max_model_len before serving: "auto" on CUDA.
    warmup: str = "auto"
    # Batch-invariant mode: a request's tokens and logprobs are bitwise the same whatever shares its
    # batch, however its prompt is chunked and whether its prefix was cached (replicas/plan.py).
    deterministic: bool = False
    # Compiled kernels persist here (shared by a node's replicas); None: `antumbra.env.kernel_cache_dir()`.
    kernel_cache_dir: str | None = None
    # One replica over tensor_parallel_size x expert_parallel_size ranks (replicas/parallel/).
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    # MTP speculative decoding (replicas/speculative/): draft tokens per step, 0 = off.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.numerics not in ("exact", "release"):
            raise ValueError(f"numerics must be 'exact' or 'release', got {self.numerics!r}")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup must be auto, on or off, got {self.warmup!r}")
