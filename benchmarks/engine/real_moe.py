"""The decode step on V4-Flash's real MoE (256 routed experts) against its byte floor.

The real-MoE slice (`real_moe_checkpoint.py`: four layers at V4-Flash widths with its 256 routed
experts, top-6, the first three layers hash-routed) is loaded from its release-layout checkpoint by
`Engine.from_pretrained`, experts kept in MXFP4 and linears in FP8 on the device. At batch 1 / 8 /
32 / 64 over 4K-token prompts, a decode step is what the public API shows: the difference of
`generate` calls of 1 and 1 + N tokens over cached prompts, over N (`lib/api_steps.py`).

The floor is the bytes a step must read at the copy bandwidth measured in the same run: attention,
shared-expert and other dense weights in their stored formats, the embedding rows of the batch,
the routed experts the step actually touched, and the KV each row attends to (`lib/decode_floor.py`).
The experts touched are counted from the routing of the timed steps: the prompts followed by the
tokens the last timed run generated are sent again with `return_routed_experts` (R3), and for each
timed step and layer the distinct experts among the batch's rows are counted (a hash layer's
routing is the token's own; a score layer's is recomputed in prefill form, which may part from the
decode step's at a bf16 near-tie). `decode_vs_floor_real_moe_B{b}` = floor ms / step ms.

Checks that gate the ratios (otherwise under `ratios_unchecked`): the engine holds the spec's 256
experts packed in every layer, every batch ran, and the greedy tokens of one prompt agree between
the captured decode graphs and the same fixed-shape step run eagerly (`graph_vs_eager`; on a CPU,
where no graph is captured, the check is recorded as not applicable).

Options (`--set name=value`): batches, ctx, new_tokens, reps, checkpoint (a directory holding the
slice; else written once to `.cache/v4-real-moe`), warmup (the engine's: "off" skips compiling
every variant at start, the untimed first runs of each batch then compile what they need), profile
("on": per batch, the kernels of the fixed-shape step run eagerly and the host's time per step, under
`profile`), moe_tiles ("T,N,KB": an experiment, not the engine's plan: in this process, decode steps
of 16 to 64 tokens run the MoE with sorted-row tiles of block_t T, block_n N, block_kb KB instead of
the ones `pick_tiles` chooses; recorded under `settings`).

The experts load packed from their stored codes (`real_moe_checkpoint.py` has the arithmetic: about
17 GB of weights served; `load_peak_bytes` records the device's peak while the engine is built); the
run writes 14 GB to `.cache` once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..lib.api_steps import api_decode_step_ms
from ..lib.context import Context
from ..lib.decode_floor import decode_floor_bytes
from ..lib.slices import REAL_MOE_SLICE, SMOKE_REAL_MOE, SliceSpec, agreement, greedy_with_logprobs, prompts
from ..lib.timing import guarded
from .real_moe_checkpoint import cached_real_moe
from .slice_steps import profile_fast_steps

DEVICE = "cuda"


@dataclass(frozen=True)
class Settings:
    batches: list[int]
    ctx: int
    new_tokens: int
    reps: int
    checkpoint: str
    warmup: str
    profile: bool
    moe_tiles: str

    @classmethod
    def of(cls, ctx: Context) -> Settings:
        small = ctx.smoke
        return cls(
            batches=ctx.option("batches", [1, 4] if small else [1, 8, 32, 64]),
            ctx=ctx.option("ctx", 128 if small else 4096),
            new_tokens=ctx.option("new_tokens", 2 if small else 32),
            reps=ctx.option("reps", 1 if small else 3),
            checkpoint=ctx.option("checkpoint", ""),
            warmup=ctx.option("warmup", "auto"),
            profile=ctx.option("profile", "off") == "on",
            moe_tiles=ctx.option("moe_tiles", ""),
        )


def run(ctx: Context) -> dict[str, Any]:
    spec = SMOKE_REAL_MOE if ctx.smoke else REAL_MOE_SLICE
    s = Settings.of(ctx)
    result: dict[str, Any] = {"slice": asdict(spec), "settings": asdict(s), "rates": ctx.rates.as_dict()}
    started = time.monotonic()
    path = Path(s.checkpoint) if s.checkpoint else cached_real_moe(ctx.device, ctx.smoke)
    result["checkpoint"] = {"path": str(path), "ready_s": time.monotonic() - started,
                            "bytes": float(sum(f.stat().st_size for f in path.glob("*.safetensors")))}
    if s.moe_tiles:
        _use_row_tiles(s.moe_tiles)
    started = time.monotonic()
    on_gpu = ctx.device.startswith("cuda")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    engine = _engine(path, ctx.device, s)
    result["load_s"] = time.monotonic() - started
    if on_gpu:
        result["load_peak_bytes"] = float(torch.cuda.max_memory_allocated())
    result["experts"] = _expert_counts(engine, spec)
    result["decode"] = {f"B{b}": guarded(lambda b=b: _decode(engine, spec, s, b, ctx)) for b in s.batches}
    result["graph_vs_eager"] = guarded(lambda: _graph_vs_eager(engine, spec, s.ctx))
    if s.profile:
        result["profile"] = {f"B{b}": guarded(lambda b=b: profile_fast_steps(
            engine, prompts(spec.vocab_size, b, s.ctx, seed=b), ctx.device)) for b in s.batches}
    _gate(result, s.batches)
    return result


def _use_row_tiles(spec: str) -> None:
    """Decode steps of 16-64 tokens take sorted-row MoE tiles "T,N,KB" in this process (the warm-up's
    variant list reads the same function, so it compiles them)."""
    from antumbra.kernels.moe_mxfp4 import triton as moe

    block_t, block_n, block_kb = (int(v) for v in spec.split(","))
    rows = moe.MoeTiles(block_t=block_t, block_n=block_n, block_kb=block_kb, use_dot=False, num_warps=4,
                        num_stages=2)
    planned = moe.pick_tiles

    def pick(num_tokens: int, top_k: int, num_experts: int) -> Any:
        return rows if 16 <= num_tokens <= 64 else planned(num_tokens, top_k, num_experts)

    moe.pick_tiles = pick  # type: ignore[assignment]


def _engine(path: Path, device: str, s: Settings) -> Any:
    from antumbra import Engine
    from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig

    max_len = s.ctx + s.new_tokens + 256
    widest = max(s.batches)
    on_gpu = device.startswith("cuda")
    return Engine.from_pretrained(
        path, device=device, dtype="bfloat16" if on_gpu else "float32",
        scheduler=SchedulerConfig(max_num_seqs=widest, max_model_len=max_len),
        # The cached prompts and, beside them, the same prompts recomputed for their routing.
        cache=CacheConfig(num_virtual_tokens=(2 * widest + 2) * max_len),
        # The release's formats kept packed on the GPU; a CPU (smoke) keeps "auto", its dense
        # PyTorch path, as the packed kernels would run in Triton's interpreter there.
        fast=FastPathConfig(expert_format="mxfp4", linear_format="fp8") if on_gpu else None,
        warmup=s.warmup,
    )


def _expert_counts(engine: Any, spec: SliceSpec) -> dict[str, Any]:
    """The routed experts the engine holds per layer (packed: MXFP4 codes; else dense); `ok` when
    every layer holds the spec's, packed on a GPU."""
    from antumbra.replicas.model.packed_experts import PackedExperts

    layers = [layer.mlp.experts for layer in engine.model.model.layers]
    packed = [isinstance(e, PackedExperts) for e in layers]
    per_layer = [int((e.w1 if p else e.gate_up_proj).shape[0]) for e, p in zip(layers, packed, strict=True)]
    on_gpu = engine.core.device.type == "cuda"
    return {"config": engine.model_config.num_experts, "per_layer": per_layer, "packed": packed,
            "ok": engine.model_config.num_experts == spec.n_routed_experts
            and per_layer == [spec.n_routed_experts] * len(layers) and (all(packed) or not on_gpu)}


def _decode(engine: Any, spec: SliceSpec, s: Settings, batch: int, ctx: Context) -> dict[str, Any]:
    batch_prompts = prompts(spec.vocab_size, batch, s.ctx, seed=batch)
    timing = api_decode_step_ms(engine, batch_prompts, s.new_tokens, s.reps, ctx.device)
    generated = timing.pop("token_ids")
    touched = experts_touched(engine, batch_prompts, generated, s.new_tokens)
    floor = decode_floor_bytes(engine, batch, s.ctx, touched["per_layer"])
    floor_ms = ctx.rates.byte_floor_us(floor["total_bytes"]) / 1e3
    return {**timing, "experts_touched": touched, "floor": floor, "floor_ms": floor_ms,
            "vs_floor": floor_ms / timing["step_ms"],
            "all_ran": all(len(g) == 1 + s.new_tokens for g in generated)}


def experts_touched(engine: Any, batch_prompts: list[list[int]], generated: list[list[int]],
                    steps: int) -> dict[str, Any]:
    """Mean over `steps` decode steps of the distinct routed experts per layer among the batch's
    rows. Step j fed generated token j at position len(prompt) + j: its routing is row
    len(prompt) + j of the prompt-plus-generated sequence's routed experts."""
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    outs = engine.generate([p + g[:steps] for p, g in zip(batch_prompts, generated, strict=True)], params)
    rows = torch.stack([o.routed_experts[len(p) : len(p) + steps].long()
                        for o, p in zip(outs, batch_prompts, strict=True)])  # [B, steps, L, k]
    num_experts = engine.model_config.num_experts
    hit = torch.zeros(steps, rows.shape[2], num_experts, dtype=torch.bool)
    for b in range(rows.shape[0]):
        hit.scatter_(2, rows[b], True)
    per_step = hit.sum(dim=2).double()  # [steps, L]
    uniform = min(num_experts, len(batch_prompts) * engine.model_config.num_experts_per_tok)
    return {"per_layer": per_step.mean(dim=0).tolist(), "min_per_layer": per_step.min(dim=0).values.tolist(),
            "bound_per_layer": uniform}


def _graph_vs_eager(engine: Any, spec: SliceSpec, ctx_len: int) -> dict[str, Any]:
    """Greedy tokens of one prompt through the captured decode graphs and through the same
    fixed-shape step run eagerly."""
    fast = engine.runner.fast
    if fast is None or not fast.use_graphs:
        return {"applies": False, "ok": True, "why": "no captured decode graphs on this device"}
    prompt = prompts(spec.vocab_size, 1, ctx_len, seed=5)[0]
    graph = greedy_with_logprobs(engine, prompt)
    fast.use_graphs = False
    try:
        eager = greedy_with_logprobs(engine, prompt)
    finally:
        fast.use_graphs = True
    return {"applies": True, "tokens_equal": graph[0] == eager[0], **agreement(graph, eager)}


def _gate(result: dict[str, Any], batches: list[int]) -> None:
    """Headline ratios only when every check passed; the rest under `ratios_unchecked`."""
    ratios = {f"decode_vs_floor_real_moe_B{b}": row["vs_floor"]
              for b in batches if "vs_floor" in (row := result["decode"][f"B{b}"])}
    ran = all("vs_floor" in row and row["all_ran"] for row in result["decode"].values())
    result["checks_ok"] = bool(ran and result["experts"]["ok"] and result["graph_vs_eager"].get("ok"))
    result["ratios" if result["checks_ok"] else "ratios_unchecked"] = ratios
