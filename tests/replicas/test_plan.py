"""Every combination of the execution settings, against the rules `plan.py` states.

Table-driven: each combination of device x numerics x dtype x step kernels x decode path x
expert / linear format x HiSparse x checkpoint layout is resolved; the conflicts listed in
`CONFLICTS` (written from the rules, not from the code) must fail with a message naming both
settings, and every other combination must resolve to a plan that keeps the invariants below.
Each distinct plan a CPU can run is then built and run on the tiny checkpoint.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest

from antumbra import Engine, SamplingParams
from antumbra.config import CacheConfig, EngineConfig, FastPathConfig, SchedulerConfig
from antumbra.replicas.plan import (
    DecodePath,
    ExecutionPlan,
    ExpertFormat,
    KVStorage,
    LinearFormat,
    NumericsMode,
    PlanError,
    SamplerImpl,
    StepKernels,
    resolve_plan,
)


@dataclass(frozen=True)
class Combo:
    device: str
    numerics: str
    dtype: str
    general_kernels: str
    decode: str
    expert_format: str
    linear_format: str
    hisparse: bool
    kv_storage: str
    deterministic: bool
    layout: str
    parallel: tuple[int, int] = (1, 1)  # (tensor, expert) parallel sizes

    def config(self) -> EngineConfig:
        return EngineConfig(
            device=self.device,
            dtype=self.dtype,
            numerics=self.numerics,
            deterministic=self.deterministic,
            tensor_parallel_size=self.parallel[0],
            expert_parallel_size=self.parallel[1],
            cache=CacheConfig(
                hisparse_rows_per_request=64 if self.hisparse else None, kv_storage=self.kv_storage
            ),
            fast=FastPathConfig(
                general_kernels=self.general_kernels,
                decode=self.decode,
                expert_format=self.expert_format,
                linear_format=self.linear_format,
            ),
        )


AXES = {
    "device": ("cpu", "cuda"),
    "numerics": ("exact", "release"),
    "dtype": ("float32", "bfloat16", "float16"),
    "general_kernels": ("auto", "on", "off"),
    "decode": ("auto", "on", "off"),
    "expert_format": ("auto", "dense", "mxfp4"),
    "linear_format": ("auto", "dense", "fp8"),
    "hisparse": (False, True),
    "kv_storage": ("auto", "model_dtype"),
    "deterministic": (False, True),
    "layout": ("hf", "release"),
    "parallel": ((1, 1), (2, 2)),
}
COMBOS = [Combo(*values) for values in itertools.product(*AXES.values())]


def _kernels_ok(c: Combo) -> bool:
    return c.numerics == "exact" and c.dtype != "float16"


def _release_ok(c: Combo) -> bool:
    """Release numerics where the fixed-shape step and the packed formats run them."""
    return c.numerics == "release" and c.dtype != "float16"


def _fixed_ok(c: Combo) -> bool:
    """The fixed-shape decode step: exact kernels, or release reading the pools' codes."""
    return _kernels_ok(c) or (_release_ok(c) and c.kv_storage == "auto")


# What a kernel setting conflicts with, when it does (the message names one of these).
WHY = "numerics='release'|dtype='float16'"


# (applies?, the two settings the message must name)
CONFLICTS = [
    (lambda c: c.general_kernels == "on" and not _kernels_ok(c), ("general_kernels='on'", WHY)),
    (lambda c: c.decode == "on" and not _fixed_ok(c),
     ("decode='on'", WHY + "|kv_storage='model_dtype'")),
    (lambda c: c.decode == "on" and c.hisparse and (c.parallel != (1, 1) or not _kernels_ok(c)),
     ("decode='on'", "hisparse_rows_per_request")),
    (lambda c: c.expert_format == "mxfp4" and not (_kernels_ok(c) or _release_ok(c)),
     ("expert_format='mxfp4'", WHY)),
    (lambda c: c.linear_format == "fp8" and not (_kernels_ok(c) or _release_ok(c)),
     ("linear_format='fp8'", WHY)),
]


def _expected_conflicts(c: Combo) -> list[tuple[str, str]]:
    return [names for applies, names in CONFLICTS if applies(c)]


def _check_invariants(c: Combo, plan: ExecutionPlan) -> None:
    cuda = c.device == "cuda"
    assert plan.device.type == c.device
    assert plan.numerics is NumericsMode(c.numerics)
    assert plan.hisparse is c.hisparse
    assert (plan.kv_storage is KVStorage.CODES) == (c.kv_storage == "auto")
    assert plan.deterministic is c.deterministic
    # Kernels and packed formats only where they implement the numerics and take the dtype.
    if plan.step_kernels is StepKernels.TRITON:
        assert _kernels_ok(c) and (c.general_kernels == "on" or (c.general_kernels == "auto" and cuda))
    else:
        assert c.general_kernels == "off" or (c.general_kernels == "auto" and not (cuda and _kernels_ok(c)))
    one_rank = c.parallel == (1, 1)
    # HiSparse page-ins of the fixed-shape step: one rank, exact numerics.
    hisparse_fixed = not c.hisparse or (one_rank and _kernels_ok(c))
    assert (plan.tensor_parallel_size, plan.expert_parallel_size) == c.parallel
    # "auto" takes the fixed-shape step on CUDA: exact always, release for a release-layout checkpoint.
    fixed_auto = cuda and hisparse_fixed and (_kernels_ok(c) or (_fixed_ok(c) and c.layout == "release"))
    if plan.decode is not DecodePath.GENERAL:
        assert _fixed_ok(c) and hisparse_fixed and c.decode != "off"
        assert (plan.decode is DecodePath.GRAPHS) == cuda
    else:
        assert c.decode == "off" or (c.decode == "auto" and not fixed_auto)
    packed_auto = cuda and c.layout == "release" and (_kernels_ok(c) or _release_ok(c))
    assert (plan.expert_format is ExpertFormat.MXFP4) == (c.expert_format == "mxfp4" or
                                                         (c.expert_format == "auto" and packed_auto))
    assert (plan.linear_format is LinearFormat.FP8) == (c.linear_format == "fp8" or
                                                       (c.linear_format == "auto" and packed_auto))
    assert (plan.sampler is SamplerImpl.TRITON) == cuda
    assert plan.warmup == cuda
    assert not plan.overlap_indexer  # off unless asked for
    assert one_rank or not plan.overlap_schedule  # the overlapped scheduling is one-rank only


def test_every_combination_resolves_or_names_its_conflict() -> None:
    allowed = 0
    for combo in COMBOS:
        expected = _expected_conflicts(combo)
        if expected:
            with pytest.raises(PlanError) as info:
                resolve_plan(combo.config(), combo.layout)
            message = str(info.value)
            assert any(
                first in message and (not second or any(alt in message for alt in second.split("|")))
                for first, second in expected
            ), f"{combo}: {message!r} names none of {expected}"
        else:
            _check_invariants(combo, resolve_plan(combo.config(), combo.layout))
            allowed += 1
    assert 0 < allowed < len(COMBOS)


def test_prompt_rows_only_where_mixed_steps_run_and_within_the_step_budget() -> None:
    """Prompt rows ride the fixed-shape step beside decodes: never on the general decode path, a
    rank gang or batch-invariant mode, and never beyond the step's token budget."""
    for combo in COMBOS:
        if _expected_conflicts(combo):
            continue
        config = combo.config()
        config = replace(config, fast=replace(config.fast, prefill_rows=64),
                         scheduler=replace(config.scheduler, max_num_batched_tokens=48))
        plan = resolve_plan(config, combo.layout)
        runs_rows = plan.mixed_steps and not combo.deterministic
        assert plan.prefill_rows == (48 if runs_rows else 0), combo
        assert not plan.prefill_rows or (plan.decode is not DecodePath.GENERAL and combo.parallel == (1, 1))


def test_parallel_sizes_below_one_fail() -> None:
    for tp, ep in ((0, 1), (1, 0), (-2, 2)):
        with pytest.raises(PlanError, match="tensor_parallel_size"):
            resolve_plan(EngineConfig(tensor_parallel_size=tp, expert_parallel_size=ep))


def _runnable_cpu_plans() -> dict[ExecutionPlan, Combo]:
    """One combination per distinct plan a CPU runs in float32 (bfloat16 runs the same code). In
    exact numerics both KV storages hold the same plain rows, so they count as one plan."""
    plans: dict[ExecutionPlan, Combo] = {}
    for combo in COMBOS:
        if (
            combo.device != "cpu"
            or combo.dtype != "float32"
            or combo.layout != "hf"
            or combo.parallel != (1, 1)
            or _expected_conflicts(combo)
            or (combo.deterministic and not _all_or_nothing(combo))
        ):
            continue
        plan = resolve_plan(combo.config(), combo.layout)
        if plan.numerics is NumericsMode.EXACT:
            plan = replace(plan, kv_storage=KVStorage.MODEL_DTYPE)
        plans.setdefault(plan, combo)
    return plans


def _all_or_nothing(c: Combo) -> bool:
    """Batch-invariant mode changes the step shapes, not which kernels run: its plans are run with
    every fast setting "auto" (the fixed-shape step in the mode, interpreted, is
    `test_deterministic.py`'s; with the other settings on it runs the same kernels as without)."""
    return (c.general_kernels, c.decode, c.expert_format, c.linear_format) == ("auto",) * 4


RUNNABLE = _runnable_cpu_plans()


@pytest.fixture(scope="module")
def one_layer_each(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with one layer of each attention kind (sliding, C4, C128; the first MoE
    hash-routed, the others score-routed): every kernel a plan picks runs, with one interpreted layer
    fewer than the default model for each of the forty-odd plans."""
    from antumbra.config import CSA, HCA, SLIDING
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("plans") / "model",
                                TinyModelSpec(layer_types=(SLIDING, CSA, HCA)))


@pytest.mark.parametrize("combo", list(RUNNABLE.values()), ids=lambda c: (
    f"{c.numerics}-k{c.general_kernels}-d{c.decode}-e{c.expert_format}-l{c.linear_format}-h{int(c.hisparse)}"
    f"-{c.kv_storage}{'-det' if c.deterministic else ''}"))
def test_every_distinct_cpu_plan_runs(one_layer_each, combo: Combo) -> None:
    config = combo.config()
    engine = Engine.from_pretrained(
        one_layer_each, numerics=combo.numerics, cache=config.cache, fast=config.fast,
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=512), deterministic=combo.deterministic,
    )
    assert engine.plan == resolve_plan(config, "hf")
    # A prefill and a decode step: every kernel of the plan runs once (interpreted, so kept short).
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    engine.check_integrity()


def test_the_step_token_budget_follows_the_device_unless_set():
    """An unset `max_num_batched_tokens` resolves per device type when the engine is built (8192 on a
    GPU, 2048 on the CPU); a set one is kept; reading it unresolved is an error that says what to do."""
    from antumbra.config import AUTO_TOKEN_BUDGET

    unset = SchedulerConfig()
    assert unset.with_token_budget("cuda").token_budget == AUTO_TOKEN_BUDGET["cuda"] == 8192
    assert unset.with_token_budget("cpu").token_budget == AUTO_TOKEN_BUDGET["cpu"] == 2048
    assert SchedulerConfig(max_num_batched_tokens=96).with_token_budget("cuda").token_budget == 96
    with pytest.raises(ValueError, match="with_token_budget"):
        _ = unset.token_budget


def test_an_engine_built_without_a_budget_gets_its_devices(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, device="cpu", scheduler=SchedulerConfig(max_num_seqs=3))
    try:
        assert engine.config.scheduler.token_budget == 2048
        assert engine.config.scheduler.max_num_seqs == 3
        out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 2
    finally:
        engine.shutdown()
