"""How an engine executes: one frozen plan, resolved in one place from the config and the device.

`EngineConfig` holds what a user asked for ("auto", "on", "off", format names); `resolve_plan`
turns it, with the device and the checkpoint's layout, into an `ExecutionPlan` of enums that the
rest of the engine reads without re-deciding anything. Every "auto" is resolved here and only
here, and a combination that cannot run fails here, before any weight is loaded, with a
`PlanError` that names both settings in conflict.

The rules (each a row of `tests/replicas/test_plan.py`):
* The Triton general-step kernels implement `exact` numerics only; in `release` numerics "auto"
  picks the PyTorch general step and an explicit request for them is a conflict.
* The fixed-shape decode step, packed MXFP4 experts and packed FP8 linears run both numerics. In
  `release` the decode step reads the pools' FP8 / FP4 codes in its kernels, so it needs KV storage
  "auto" (codes; "model_dtype" keeps the general step under "auto" and conflicts with "on"). Its
  GPU check is the GPU-marked `tests/replicas/test_gpu_paths.py` (the fixed-shape step against the
  general step in float32, within the spread rounding alone gives); on the CPU every release kernel
  is checked against its PyTorch definition by the kernel tests.
* The kernels take float32 or bfloat16 activations: float16 keeps the PyTorch path ("auto"),
  an explicit request is a conflict.
* The fixed-shape decode step serves HiSparse on one rank (its page-ins run on the device,
  `model/fixed_attention.py`); with more than one rank the hot buffers' page-ins are not replayed on
  the other ranks, so there "auto" falls back to the general step and "on" with
  `hisparse_rows_per_request` is a conflict.
* "auto" turns the kernels, the fixed-shape decode step and the warm-up on for CUDA devices;
  CUDA graphs need a CUDA device (elsewhere the fixed-shape step runs eagerly).
* "auto" weight formats keep the checkpoint's packed formats on CUDA (a release-layout
  checkpoint): MXFP4 experts, FP8 linears. Packing a dense checkpoint is a lossy quantisation,
  done only when asked for.
* KV storage "auto" stores the codes the numerics mode rounds to (release: FP8 KV rows and FP4
  indexer keys; exact: the model dtype); "model_dtype" stores their values unpacked.
* The sampler's race runs as the Triton kernel on CUDA and as its PyTorch reference elsewhere,
  unless `sampler` names one.
* `deterministic` (batch-invariant mode): a request's tokens and logprobs are bitwise the same
  alone and inside any batch. Every kernel here computes a row from that row's data alone (no
  reduction runs across rows; split-K partials, MoE pairs and the top-k's lists are summed or
  sorted in a fixed order), so what can change a row's arithmetic is only a launch choice taken
  from the step's shape: the FP8 linears' config and K split and the MoE tiles follow T, the
  attention splits and the mHC / compressor splits follow T and the device, cuBLAS picks its
  kernel by M. So the mode fixes every step's shape: the chunk budget is one token, and every
  one-token chunk the fixed-shape step takes (decodes and prompt tokens alike) runs there at one
  padded size (`invariant_batch_size`, one CUDA graph); any other chunk (a verify chunk, a request
  that wants its prompt's rows, a replayed SWA prefix) runs as a one-token forward of its own
  (`runner.py`). The kernels, graphs and packed formats then resolve as without the mode; where
  the fixed-shape step does not run (CPU "auto"), every chunk runs alone.
* The scheduling policy is "fair_share" (virtual token counters across tenants) or "fifo"; any
  other name fails here.
* `tensor_parallel_size` and `expert_parallel_size` are at least 1, and the model's head, group
  and expert counts must divide (checked by `parallel.spec.ShardSpec.check` once config.json is
  read). With more than one rank every rank runs the same step: the fixed-shape decode step too
  (its collectives captured in each rank's CUDA graphs); only the overlapped scheduling stays
  one-rank.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from antumbra.config import EngineConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class PlanError(ValueError):
    """Settings that cannot run together; the message names them."""


class NumericsMode(enum.Enum):
    EXACT = "exact"
    RELEASE = "release"


class KVStorage(enum.Enum):
    CODES = "codes"  # the numerics mode's stored format (packed FP8 / FP4 codes in release)
    MODEL_DTYPE = "model_dtype"


class StepKernels(enum.Enum):
    TRITON = "triton"
    TORCH = "torch"


class DecodePath(enum.Enum):
    GRAPHS = "graphs"  # fixed-shape step replayed from a CUDA graph per batch size
    FIXED_SHAPE = "fixed_shape"  # the same step run eagerly
    GENERAL = "general"  # decodes go through the general step like prefill chunks


class ExpertFormat(enum.Enum):
    DENSE = "dense"
    MXFP4 = "mxfp4"


class LinearFormat(enum.Enum):
    DENSE = "dense"
    FP8 = "fp8"


class SchedulingPolicyKind(enum.Enum):
    FAIR_SHARE = "fair_share"
    FIFO = "fifo"


class SamplerImpl(enum.Enum):
    TRITON = "triton"
    TORCH = "torch"


@dataclass(frozen=True)
class ExecutionPlan:
    device: torch.device
    dtype: torch.dtype
    numerics: NumericsMode
    kv_storage: KVStorage
    step_kernels: StepKernels
    decode: DecodePath
    expert_format: ExpertFormat
    linear_format: LinearFormat
    sampler: SamplerImpl
    hisparse: bool
    deterministic: bool  # batch-invariant mode: every step's shape fixed (decodes padded to one size)
    warmup: bool  # warm every kernel variant and graph before serving
    capture_at_start: bool  # capture the decode graphs when the engine starts (else on first use)
    overlap_indexer: bool  # CSA indexers on a second CUDA stream in the decode graphs
    overlap_schedule: bool  # schedule step n+1 while the fixed-shape step n runs (replicas/overlap.py)
    mixed_steps: bool = False  # decode rows beside prefill chunks on the fixed-shape step (runner.py)
    prefill_rows: int = 0  # prompt tokens a step beside decodes runs as fixed-shape rows (runner.py)
    scheduling: SchedulingPolicyKind = SchedulingPolicyKind.FAIR_SHARE
    tensor_parallel_size: int = 1  # attention heads split over this many ranks
    expert_parallel_size: int = 1  # routed experts split over this many rank groups

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def world_size(self) -> int:
        """Ranks of the replica: tensor x expert parallel."""
        return self.tensor_parallel_size * self.expert_parallel_size


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise PlanError(f"unsupported dtype {dtype}; choose one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise PlanError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_plan(config: EngineConfig, checkpoint_layout: str = "hf") -> ExecutionPlan:
    """The plan for `config` on its device; `checkpoint_layout` is "release" or "hf"."""
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype)
    numerics = NumericsMode(config.numerics)
    fast = config.fast
    on_cuda = device.type == "cuda"
    hisparse = config.cache.hisparse_rows_per_request is not None
    exact = numerics is NumericsMode.EXACT
    deterministic = config.deterministic
    kernels_ok = exact and dtype in _KERNEL_DTYPES
    # Release numerics on the fixed-shape decode step and packed weights (not the general kernels).
    release_ok = not exact and dtype in _KERNEL_DTYPES
    release_codes = release_ok and config.cache.kv_storage == "auto"

    def why_not_kernels(setting: str) -> str:
        if not exact:
            return f"{setting} conflicts with numerics='release': the kernels implement exact numerics only"
        return f"{setting} conflicts with dtype={config.dtype!r}: the kernels take float32 or bfloat16"

    if fast.general_kernels == "on" and not kernels_ok:
        raise PlanError(why_not_kernels("general_kernels='on'"))
    use_kernels = fast.general_kernels == "on" or (fast.general_kernels == "auto" and on_cuda and kernels_ok)

    if fast.decode == "on" and release_ok and not release_codes:
        raise PlanError("decode='on' conflicts with numerics='release' and kv_storage='model_dtype': the "
                        "fixed-shape release step reads the pools' FP8 / FP4 codes")
    if fast.decode == "on" and not (kernels_ok or release_codes):
        raise PlanError(why_not_kernels("decode='on'"))
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    if tp < 1 or ep < 1:
        raise PlanError(
            f"tensor_parallel_size and expert_parallel_size must be at least 1, got {tp} and {ep}")
    hisparse_gang = hisparse and tp * ep > 1
    if fast.decode == "on" and hisparse_gang:
        raise PlanError(f"decode='on' conflicts with hisparse_rows_per_request at tensor_parallel_size={tp}, "
                        f"expert_parallel_size={ep}: the fixed-shape step pages HiSparse rows in on one "
                        "rank only")
    # HiSparse on the fixed-shape step pages rows in for the exact kernels only (not with release codes).
    hisparse_release = hisparse and not kernels_ok
    if fast.decode == "on" and hisparse_release:
        raise PlanError("decode='on' conflicts with hisparse_rows_per_request in numerics='release': the "
                        "fixed-shape step pages HiSparse rows in for exact numerics only")
    release_layout = checkpoint_layout == "release"
    fixed_auto = on_cuda and not hisparse_gang and not hisparse_release and (
        kernels_ok or (release_codes and release_layout))
    fixed = fast.decode == "on" or (fast.decode == "auto" and fixed_auto)
    decode = DecodePath.GENERAL
    if fixed:
        decode = DecodePath.GRAPHS if on_cuda and fast.cuda_graphs else DecodePath.FIXED_SHAPE

    formats_ok = kernels_ok or release_ok
    packed = on_cuda and release_layout and formats_ok
    if fast.expert_format == "mxfp4" and not formats_ok:
        raise PlanError(why_not_kernels("expert_format='mxfp4'"))
    if fast.linear_format == "fp8" and not formats_ok:
        raise PlanError(why_not_kernels("linear_format='fp8'"))
    experts = ExpertFormat.MXFP4 if fast.expert_format == "mxfp4" or (
        fast.expert_format == "auto" and packed) else ExpertFormat.DENSE
    linears = LinearFormat.FP8 if fast.linear_format == "fp8" or (
        fast.linear_format == "auto" and packed) else LinearFormat.DENSE

    sampler = SamplerImpl.TRITON if fast.sampler == "triton" or (fast.sampler == "auto" and on_cuda) \
        else SamplerImpl.TORCH
    warmup = config.warmup == "on" or (config.warmup == "auto" and on_cuda)
    kinds = [k.value for k in SchedulingPolicyKind]
    if config.scheduler.policy not in kinds:
        raise PlanError(f"unknown scheduler policy {config.scheduler.policy!r}; choose one of {kinds}")
    # One rank only, as yet: a gang's ranks would replay the two parts of a step as two messages.
    mixed = decode is not DecodePath.GENERAL and fast.mixed_steps and tp * ep == 1
    return ExecutionPlan(
        device=device,
        dtype=dtype,
        numerics=numerics,
        kv_storage=KVStorage.CODES if config.cache.kv_storage == "auto" else KVStorage.MODEL_DTYPE,
        step_kernels=StepKernels.TRITON if use_kernels else StepKernels.TORCH,
        decode=decode,
        expert_format=experts,
        linear_format=linears,
        sampler=sampler,
        hisparse=hisparse,
        deterministic=deterministic,
        warmup=warmup,
        capture_at_start=decode is DecodePath.GRAPHS and fast.capture_at_start,
        overlap_indexer=decode is DecodePath.GRAPHS and fast.overlap_indexer,
        # One rank only: a gang broadcasts each forward before it runs, step by step.
        overlap_schedule=decode is not DecodePath.GENERAL and fast.overlap_schedule and tp * ep == 1,
        mixed_steps=mixed,
        # Batch-invariant mode runs every prompt token alone, at one padded size; a step never holds
        # more prompt tokens than its token budget, so no graph is built for more.
        prefill_rows=min(fast.prefill_rows, config.scheduler.max_num_batched_tokens or fast.prefill_rows)
        if mixed and not deterministic else 0,
        scheduling=SchedulingPolicyKind(config.scheduler.policy),
        tensor_parallel_size=tp,
        expert_parallel_size=ep,
    )


def invariant_batch_size(config: EngineConfig) -> int:
    """The one padded size batch-invariant mode runs the fixed-shape step at: the largest graph
    size the scheduler can fill (max_num_seqs when no configured size is that small).

    Invariant: every launch of the fixed-shape step (its kernels' tiles and splits, cuBLAS's
    choice by M, the attention and compressor plans) is a function of its padded size and
    max_model_len, and each kernel computes a row from that row alone; one size for every step
    therefore gives a row the same arithmetic whatever else the step holds. A step with more such
    chunks than this runs them in several replays of the same graph (`runner.py`)."""
    sizes = [b for b in config.fast.cuda_graph_batch_sizes if b <= config.scheduler.max_num_seqs]
    return max(sizes) if sizes else config.scheduler.max_num_seqs
