"""The engine on one GPU against transformers' eager DeepSeek-V4, on a 4-layer slice at V4-Flash widths.

One run: the ceilings (copy bandwidth, bf16 matmul rate); greedy agreement of the GPU
engine (fast decode path with CUDA graphs, and the general path) with the CPU fp32 engine
on the tiny checkpoint; then the slice (random weights, routed experts MXFP4-representable
so both sides compute the same function; ours keep them packed) at batch 1 / 8 / 64 and
context 4K / 16K / 64K: prefill time and decode step time, against transformers on the
same weights in the same process, and against the decode step's byte floor.

    python -m benchmarks.engine_gpu [--smoke] [--contexts 4096,16384,65536] [--batches 1,8,64]

Results: `benchmarks/results/<date>-h200-engine-gpu.json` with a `ratios` table, merged into
`<date>-h200.json` beside the kernel figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .common import environment, write_result
from .gpu_measure import copy_gbps, matmul_tflops
from .targets import summarize


@dataclass(frozen=True)
class SliceSpec:
    """The V4-Flash slice of BASELINES.md (transformers measured there at 38.6 ms a decode step)."""

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


def hf_config(spec: SliceSpec) -> Any:
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
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )


# ---------------------------------------------------------------- random weights, drawn on the device


@torch.no_grad()
def randomize_(model: torch.nn.Module, num_experts: int, seed: int = 0) -> None:
    """Redraw every tensor the way the tiny checkpoints do (fan-in linears, norms near 1), on its device."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, t in model.state_dict(keep_vars=True).items():
        leaf = name.rsplit(".", 1)[-1]

        def normal(std: float, mean: float = 0.0, t: torch.Tensor = t) -> torch.Tensor:
            return torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32) * std + mean

        if leaf == "tid2eid":
            order = torch.rand((t.shape[0], num_experts), generator=gen, device=t.device).argsort(dim=1)
            t.copy_(order[:, : t.shape[1]].to(t.dtype))
            continue
        if name == "model.embed_tokens.weight":
            drawn = normal(1.0)
        elif name == "lm_head.weight":
            drawn = normal(4.0 / math.sqrt(t.shape[-1]))
        elif name.endswith("norm.weight"):
            drawn = normal(0.1, 1.0)
        elif leaf in ("sinks", "position_bias", "base", "hc_base"):
            drawn = normal(0.5)
        elif leaf in ("scale", "hc_scale"):
            drawn = 0.5 + torch.rand(t.shape, generator=gen, device=t.device)
        elif leaf == "e_score_correction_bias":
            drawn = normal(0.1)
        else:
            drawn = normal(1.0 / math.sqrt(t.shape[-1]))
        t.copy_(drawn.to(t.dtype))


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


def build_hf(spec: SliceSpec, device: str, dtype: torch.dtype) -> Any:
    """transformers' model with weights in the release's formats: FP8-block linears, MXFP4 experts
    (stored dequantised in `dtype`, which holds those values exactly)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device(device):
        model = DeepseekV4ForCausalLM(hf_config(spec)).to(dtype)
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
                 general_kernels: str = "auto", tokenizer: Any = None) -> Any:
    """Our engine over a copy of the transformers model's weights, kept packed on the device in the
    release's formats (MXFP4 experts, FP8 linears); `deterministic` (batch-invariant mode) keeps
    them dense, as that mode's one-token PyTorch steps need. The weights are release-rounded, so the
    engine is told the checkpoint is release-layout: in `release` numerics "auto" then takes the
    packed formats and the fixed-shape decode step with CUDA graphs (FP8 / FP4 pools read as codes).
    `dense` keeps every weight in the model dtype (the packed values, exactly)."""
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
        # The engine's default step budget for the device (`AUTO_TOKEN_BUDGET`); --prefill-chunk-alt
        # times the 16K prefill at another.
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len).with_token_budget(
            torch.device(device).type),
        fast=FastPathConfig(
            # Batch-invariant mode keeps "auto" (dense); release numerics resolve "auto" to the packed
            # formats for a release-layout checkpoint.
            expert_format="dense" if dense else "auto" if deterministic or numerics != "exact" else "mxfp4",
            linear_format="dense" if dense else "auto" if deterministic or numerics != "exact" else "fp8",
            general_kernels=general_kernels,
            cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
            cuda_graphs=graphs,
            capture_at_start=capture_at_start,
            decode=decode,
        ),
        deterministic=deterministic,
        warmup=warmup,
    )
    return Engine(model, tokenizer, config, checkpoint_layout="release")


# ---------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(vocab: int, batch: int, ctx: int, seed: int, shared: int) -> list[list[int]]:
    """`batch` prompts of `ctx` tokens sharing their first `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(2, vocab, (ctx - shared,), generator=g).tolist() for _ in range(batch)]


def engine_prefill_s(engine: Any, prompt: list[int], device: str) -> float:
    """Time to the first token of one prompt, nothing cached."""
    from antumbra import SamplingParams

    engine.clear_cache()
    _sync(device)
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    _sync(device)
    return time.perf_counter() - start


def engine_decode_ms(engine: Any, prompts: list[list[int]], device: str, steps: int, warmup: int = 3) -> dict:
    """ms per decode step with every prompt decoding; the prefix is cached by one finished request first."""
    from antumbra import SamplingParams

    engine.clear_cache()
    engine.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    # Long enough that no request finishes while others ramp up or during the timed steps (a
    # shrinking batch would time other graph sizes and their captures); all are aborted after.
    params = SamplingParams(
        max_tokens=engine.max_model_len - len(prompts[0]) - 1, temperature=0.0, ignore_eos=True
    )
    ids = [engine.core.add_request(p, params) for p in prompts]
    fast = engine.runner.fast
    if fast is not None:
        fast.validate = True  # the ramp-up checks every fast step's rows; the timed steps do not
    while any(len(engine.core.requests[r].output_token_ids) < 1 for r in ids):
        engine.core.step()
    for _ in range(warmup):
        engine.core.step()
    if fast is not None:
        fast.validate = False
    fast_steps = fast.num_steps if fast else 0
    overlap = engine.core.overlap
    overlapped, drains = overlap.num_overlapped_steps, overlap.num_drains
    step_ms = _timed_steps(engine, steps, device)
    on_fast = (fast.num_steps - fast_steps) if fast else 0
    on_overlap = overlap.num_overlapped_steps - overlapped
    drained = overlap.num_drains - drains  # timed steps that waited for the last one's tokens first
    running = len(engine.core.scheduler.running)
    no_overlap_ms = None
    if overlap.enabled:  # the same steps with the host waiting for each step's tokens
        overlap.enabled = False
        no_overlap_ms = _timed_steps(engine, steps, device)
        overlap.enabled = True
    diagnosis = {}
    if len(prompts) >= 32 and device.startswith("cuda"):  # where the host's time goes at large batches
        diagnosis = {"sync_probe": _sync_probe(engine, steps), "host_profile": host_profile(engine, steps)}
    graph_ms = _graph_replay_ms(fast, len(prompts), device)
    overlap_ms = _overlap_replay_ms(fast, len(prompts), device)
    for r in ids:
        engine.core.abort(r)
    from .engine_round2 import settle

    settle(engine)
    return {"step_ms": step_ms, "tokens_per_s": len(prompts) * 1e3 / step_ms, "fast_path_steps": on_fast,
            "overlapped_steps": on_overlap, "drained_steps": drained,
            "running": running, "all_running": running == len(prompts),
            "timed_steps": steps, "graph_replay_ms": graph_ms, "graph_replay_ms_overlap_indexer": overlap_ms,
            "step_ms_no_overlap": no_overlap_ms, **diagnosis}


def _sync_probe(engine: Any, steps: int) -> dict[str, Any]:
    """Synchronising CUDA calls the host makes in `steps` decode steps (torch's sync debug mode: a
    pageable copy, `.item()`, a stream sync; not the event waits the overlap means to make), each
    with the innermost project frames of its call stack, and the drains among those steps."""
    drains = engine.core.overlap.num_drains

    def run() -> None:
        for _ in range(steps):
            engine.core.step()

    found = _syncs_during(run)
    return {"steps": steps, "syncs": found, "drains": engine.core.overlap.num_drains - drains}


def prefill_sync_probe(engine: Any, prompt: list[int], device: str) -> dict[str, Any]:
    """`_sync_probe` over one prefill (nothing cached, as `engine_prefill_s`): the synchronising
    calls by call site. A copy from pageable memory made with non_blocking=True does not warn (it
    still waits, in the driver): `prefill_profile`'s pageable_copies counts those."""
    found = _syncs_during(lambda: engine_prefill_s(engine, prompt, device))
    return {"syncs": found, "total": sum(found.values())}


def _syncs_during(fn: Any) -> dict[str, int]:
    """Calls of `fn` that synchronise with the device (torch.cuda.set_sync_debug_mode(1)), by their
    innermost project frames."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def record(*_args: Any, **_kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "antumbra" in f.filename or "benchmarks" in f.filename]
        if frames and frames[-1].name == "_syncs_during":
            return  # switching the mode on warns once
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-5:]))
        found[where] = found.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return found


def _timed_steps(engine: Any, steps: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.core.step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def _overlap_replay_ms(fast: Any, batch: int, device: str) -> float | None:
    """The same graph captured with the CSA indexers on a second stream (the last step's inputs,
    replayed: it rewrites the same rows with the same values), then the configured mode again."""
    if fast is None or not fast.use_graphs:
        return None
    was = fast.overlap_indexer
    fast.set_overlap_indexer(not was)
    flipped = _graph_replay_ms(fast, batch, device)
    fast.set_overlap_indexer(was)
    return flipped if not was else _graph_replay_ms(fast, batch, device)


def _graph_replay_ms(fast: Any, batch: int, device: str, reps: int = 20) -> float | None:
    """The captured decode graph alone (no scheduling, sampling or host copies)."""
    if fast is None or not fast.use_graphs:
        return None
    graph, _ = fast.graph_for(batch)
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(reps):
        graph.replay()
    end_ev.record()
    end_ev.synchronize()
    return start_ev.elapsed_time(end_ev) / reps


def profile_fast_step(engine: Any, prompt: list[int], device: str, steps: int = 3) -> dict[str, Any]:
    """Kernel-level breakdown of the fixed-shape decode step run eagerly (no graph): how many
    launches a step makes and where its device time goes."""
    from torch.profiler import ProfilerActivity, profile

    from antumbra import SamplingParams

    fast = engine.runner.fast
    if fast is None or not device.startswith("cuda"):
        return {"skipped": "no fast path on this device"}
    engine.clear_cache()
    rid = engine.core.add_request(
        prompt, SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    )
    while not engine.core.requests[rid].output_token_ids:
        engine.core.step()
    engine.core.step()
    host = host_profile(engine, steps=20)
    saved, fast.use_graphs = fast.use_graphs, False
    try:
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.core.step()
            _sync(device)
    finally:
        fast.use_graphs = saved
        engine.core.abort(rid)
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total_us = sum(e.device_time_total for e in rows) / steps
    launches = sum(e.count for e in rows) / steps
    top = [{"name": e.key[:90], "us_per_step": e.device_time_total / steps, "calls_per_step": e.count / steps}
           for e in rows[:80]]
    return {"kernel_us_per_step": total_us, "launches_per_step": launches, "top": top, "host": host}


def prefill_profile(engine: Any, prompt: list[int], device: str) -> dict[str, Any]:
    """Kernel-level breakdown of one prefill (nothing cached): device time per kernel name, the
    device's busy time against the wall time (the rest is the device waiting for the host)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall_s = engine_prefill_s(engine, prompt, device)
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    busy_us = sum(e.device_time_total for e in rows)
    top = [{"name": e.key[:90], "ms": e.device_time_total / 1e3, "calls": e.count} for e in rows[:40]]
    pageable = sum(e.count for e in rows if "Pageable" in e.key)  # each waited for the stream
    return {"wall_s": wall_s, "device_busy_s": busy_us / 1e6, "pageable_copies": pageable, "top": top}


def host_profile(engine: Any, steps: int) -> dict[str, Any]:
    """Where the host's time of a graph-mode step goes: cProfile's cumulative time per function
    (microseconds per step), the functions above 20 us."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.core.step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, ncalls, _tt, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        us = cumtime * 1e6 / steps
        if us >= 20:
            rows.append({"function": f"{Path(file).name}:{line}:{func}", "us_per_step": us,
                         "calls_per_step": ncalls / steps})
    rows.sort(key=lambda r: r["us_per_step"], reverse=True)
    return {"steps": steps, "rows": rows[:60]}


def hf_run(model: Any, prompts: list[list[int]], device: str, new_tokens: int) -> dict:
    """transformers' generate: prefill alone (1 new token); the decode step from the difference of
    two runs that share the prefill (`new_tokens` and 2 * `new_tokens` new tokens)."""
    ids = torch.tensor(prompts, device=device)

    def timed(n: int) -> tuple[float, Any]:
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        return time.perf_counter() - start, out

    try:
        with torch.no_grad():
            model.generate(ids[:, :64], max_new_tokens=2, do_sample=False)  # warm-up outside the timing
            prefill_s, first = timed(1)
            short_s, _ = timed(new_tokens)
            long_s, out = timed(2 * new_tokens)
    except torch.OutOfMemoryError as exc:
        return {"error": "out of memory", "detail": str(exc).splitlines()[0][:300]}
    finally:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    step_ms = (long_s - short_s) * 1e3 / new_tokens
    return {"prefill_s": prefill_s, "step_ms": step_ms, "tokens_per_s": len(prompts) * 1e3 / step_ms,
            "first_token": first[:, -1].tolist(), "tokens": out[:, ids.shape[1]:].tolist()}


# ---------------------------------------------------------------- floors and checks


def decode_floor_bytes(engine: Any, batch: int, ctx: int) -> dict[str, float]:
    """Fewest bytes one decode step must read: every weight a token touches once (the embedding's
    rows, the routed experts hit at most `min(E, batch*k)` times per layer, packed), plus the
    keys each row attends to and the indexer keys it scores."""
    from antumbra.replicas.model.packed_experts import PackedExperts

    cfg = engine.model_config
    weights = 0
    experts_bytes = 0.0
    for name, t in engine.model.state_dict().items():
        size = t.numel() * t.element_size()
        if name == "model.embed_tokens.weight":
            weights += batch * t.shape[1] * t.element_size()
        elif ".experts." in name:
            experts_bytes += size
        else:
            weights += size
    packed = all(isinstance(layer.mlp.experts, PackedExperts) for layer in engine.model.model.layers)
    hit = min(cfg.num_experts, batch * cfg.num_experts_per_tok) / cfg.num_experts
    weights += int(experts_bytes * hit)
    elt = 2
    kv = 0
    for kind in cfg.layer_types:
        rows = cfg.sliding_window
        if kind == "compressed_sparse_attention":
            rows += cfg.index_topk
            kv += (ctx // 4) * cfg.index_head_dim * elt  # indexer keys scored
        elif kind == "heavily_compressed_attention":
            rows += ctx // 128
        kv += rows * cfg.head_dim * elt
    return {"weight_bytes": float(weights), "kv_bytes": float(batch * kv), "experts_packed": packed,
            "total_bytes": float(weights + batch * kv)}


def tiny_agreement(device: str, num_tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens of the GPU engine (fast path with graphs; general path; packed MXFP4 experts)
    against the CPU fp32 engine on the tiny checkpoint."""
    import tempfile
    from pathlib import Path

    from antumbra import Engine, SamplingParams
    from antumbra.config import FastPathConfig
    from antumbra.replicas.model.release_format import save_release_checkpoint
    from antumbra.replicas.model.tiny import TinyModelSpec, build_model, make_tiny_checkpoint

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 261, (n,), generator=g).tolist() for n in (1, 5, 129, 300, 700)]
    result: dict[str, Any] = {"num_tokens": num_tokens, "prompt_lens": [len(p) for p in prompts]}
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        spec = TinyModelSpec(seed=5)
        release = save_release_checkpoint(
            build_model(spec).state_dict(), build_config_of(spec), Path(tmp) / "rel"
        )
        for label, path, fast in (
            ("fast_graphs", plain, FastPathConfig(decode="auto")),
            ("general", plain, FastPathConfig(decode="off")),
            ("fast_graphs_mxfp4_experts", release, FastPathConfig(decode="auto", expert_format="mxfp4")),
            # The CSA indexers on a second stream inside the graphs (FastPathConfig.overlap_indexer).
            ("fast_graphs_overlap_indexer", plain, FastPathConfig(decode="auto", overlap_indexer=True)),
        ):
            cpu = Engine.from_pretrained(path, device="cpu", dtype="float32").generate(prompts, params)
            engine = Engine.from_pretrained(path, device=device, dtype="float32", fast=fast)
            gpu = engine.generate(prompts, params)
            engine.check_integrity()
            same = [a.token_ids == b.token_ids for a, b in zip(cpu, gpu, strict=True)]
            fast_steps = engine.runner.fast.num_steps if engine.runner.fast else 0
            result[label] = {"all_identical": all(same), "identical": same, "fast_path_steps": fast_steps}
    labels = ("fast_graphs", "general", "fast_graphs_mxfp4_experts", "fast_graphs_overlap_indexer")
    result["all_identical"] = all(result[k]["all_identical"] for k in labels)
    return result


def build_config_of(spec: Any) -> Any:
    from antumbra.replicas.model.tiny import build_config

    return build_config(spec)


def logits_agreement(engine: Any, hf_model: Any, vocab: int, device: str, length: int = 384) -> dict:
    """Last-position logits of one prompt, ours against transformers (bf16 both)."""
    prompt = _prompts(vocab, 1, length, seed=11, shared=0)[0]
    engine.clear_cache()
    ours = engine.prompt_logits(prompt)[-1].double()
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt], device=device)).logits[0, -1].double().cpu()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    return {"prompt_len": length, "rel_err": rel, "same_argmax": int(ours.argmax()) == int(theirs.argmax())}


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    spec = SMOKE_SLICE if args.smoke else SliceSpec()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, Any] = {**environment(), "smoke": args.smoke, "slice": asdict(spec), "ratios": {},
                              "contexts": contexts, "batches": batches}
    name = (
        ("h200" if "H200" in result["device"] else device) + "-engine-gpu" + ("-smoke" if args.smoke else "")
    )

    def save() -> None:
        write_result(name, result)

    result["copy_gbps"] = copy_gbps(device)
    result["matmul_tflops"] = matmul_tflops(device)
    if not args.no_tiny:
        result["tiny_gpu_vs_cpu"] = _guarded(lambda: tiny_agreement(device))
        save()
    hf = build_hf(spec, device, getattr(torch, dtype))
    result["params"] = sum(p.numel() for p in hf.parameters())
    hf_new_tokens = 4 if args.smoke else 8
    result["transformers"] = {}
    for batch, ctx in ((1, contexts[0]), (min(8, max(batches)), contexts[0])) + tuple(
        (1, c) for c in contexts[1:]
    ):
        key = f"B{batch}_ctx{ctx}"
        prompts = _prompts(spec.vocab_size, batch, ctx, seed=batch * 7 + ctx, shared=0)
        result["transformers"][key] = _guarded(lambda p=prompts: hf_run(hf, p, device, hf_new_tokens))
        save()
        print(key, "transformers", result["transformers"][key].get("step_ms"), flush=True)
    result["engine"] = {}
    from . import engine_round2 as r2

    def prefill(engine: Any, n: int) -> None:
        prompt = _prompts(spec.vocab_size, 1, n, seed=n, shared=0)[0]
        row = _guarded(lambda: {"s": engine_prefill_s(engine, prompt, device)})
        row["flops"] = r2.prefill_flops(hf, spec, n)
        if args.profile_prefill and device == "cuda":
            row["profile"] = _guarded(lambda: prefill_profile(engine, prompt, device))
            row["sync_probe"] = _guarded(lambda: prefill_sync_probe(engine, prompt, device))
        result["engine"][f"prefill_B1_ctx{n}"] = row
        print(f"prefill_B1_ctx{n}", row.get("s"), row.get("error", ""), flush=True)

    for ctx in contexts:
        ctx_batches = batches if ctx == contexts[0] else args.long_batches
        engine = build_engine(hf, device, dtype, max_model_len=ctx + 256, max_num_seqs=max(ctx_batches),
                              num_virtual_tokens=max(ctx_batches) * (ctx + 512) + ctx + 4096,
                              graphs=not args.no_graphs)
        if ctx == contexts[0]:
            result["exact_bytes"] = r2.pool_bytes_per_token(engine)
            # Before anything else ran on this engine, and again after the profile (which aborts a
            # request with a step in flight): the two must agree.
            result["logits_vs_transformers_fresh"] = _guarded(
                lambda e=engine: logits_agreement(e, hf, spec.vocab_size, device)
            )
            result["profile_B1"] = _guarded(lambda e=engine, c=ctx: profile_fast_step(
                e, _prompts(spec.vocab_size, 1, c, seed=3, shared=0)[0], device))
            result["logits_vs_transformers"] = _guarded(
                lambda e=engine: logits_agreement(e, hf, spec.vocab_size, device)
            )
        budget = engine.core.scheduler.cfg.token_budget
        warm = _prompts(spec.vocab_size, 1, min(budget, ctx), seed=1, shared=0)[0]
        engine_prefill_s(engine, warm, device)  # compiles the prefill kernels
        extra = {p for p in args.prefill_extra if p <= ctx} if ctx == contexts[-1] else set()
        for n in sorted({ctx} | extra):
            prefill(engine, n)
        if ctx == contexts[-1] and args.prefill_chunk_alt:
            # The same prefill in steps of a larger token budget (fewer, larger GEMMs per chunk).
            import dataclasses

            sched = engine.core.scheduler
            kept, sched.cfg = sched.cfg, dataclasses.replace(sched.cfg,
                                                             max_num_batched_tokens=args.prefill_chunk_alt)
            n = min(ctx, 16384)
            prompt = _prompts(spec.vocab_size, 1, n, seed=n, shared=0)[0]
            chunk = args.prefill_chunk_alt
            _guarded(lambda e=engine, p=prompt[:chunk]: engine_prefill_s(e, p, device))  # compiles
            row = _guarded(lambda e=engine, p=prompt: {"s": engine_prefill_s(e, p, device)})
            row["flops"], row["chunk_tokens"] = r2.prefill_flops(hf, spec, n), args.prefill_chunk_alt
            result["engine"][f"prefill_chunk{args.prefill_chunk_alt}_ctx{n}"] = row
            sched.cfg = kept
        save()
        for batch in ctx_batches:
            # Independent contexts: every row reads its own KV. Rows sharing all but 32 tokens of their
            # context read mostly the same pages (L2 hits), so that case is reported beside it, named so.
            cases = [("", 0)] + ([("_shared_prefix", ctx - 32)] if batch > 1 and args.shared_prefix else [])
            for suffix, shared in cases:
                prompts = _prompts(spec.vocab_size, batch, ctx, seed=ctx + batch, shared=shared)
                key = f"decode_B{batch}_ctx{ctx}{suffix}"
                result["engine"][key] = _guarded(lambda e=engine, p=prompts: engine_decode_ms(e, p, device,
                                                                                              args.steps))
                result["engine"][key]["floor"] = decode_floor_bytes(engine, batch, ctx)
                save()
                row = result["engine"][key]
                print(key, row.get("step_ms"), row.get("step_ms_no_overlap"), row.get("graph_replay_ms"),
                      row.get("running"), row.get("error", ""), flush=True)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    # `release` numerics and HiSparse: B1 decode steps against the exact fast path's.
    for label, ctx, kwargs in (("release", args.release_ctx, {"numerics": "release"}),
                               # "on": the fixed-shape step with its device page-ins, or a PlanError.
                               ("hisparse", args.hisparse_ctx, {"hisparse_rows": args.hisparse_rows,
                                                                "decode": "on"})):
        if not ctx:
            continue

        def variant(ctx: int = ctx, kwargs: dict = kwargs, label: str = label) -> dict[str, Any]:
            def engine_with(**extra: Any) -> Any:
                return build_engine(hf, device, dtype, max_model_len=ctx + 256, max_num_seqs=2,
                                    num_virtual_tokens=2 * ctx + 8192, graphs=not args.no_graphs, **extra)

            engine = engine_with(**kwargs)
            prompt = _prompts(spec.vocab_size, 1, ctx, seed=ctx + 1, shared=0)[0]
            row = {"ctx": ctx, "prefill_s": engine_prefill_s(engine, prompt, device),
                   "bytes": r2.pool_bytes_per_token(engine), **kwargs}
            row.update(r2.variant_decode(engine, prompt, max(5, args.steps // 2), device))
            ours = _greedy_with_logprobs(engine, prompt)
            _release(engine)
            # The same decode on the path it replaces: the general step in the same mode (release
            # numerics; HiSparse with its host-side page-ins), so that both decode the same prefill.
            reference = engine_with(**{**kwargs, "decode": "off"})
            row["agreement"] = _agreement(ours, _greedy_with_logprobs(reference, prompt))
            _release(reference)
            if label == "release":
                from .release_shadow_gpu import release_gate

                row["bf16_vs_general"] = row.pop("agreement")
                row["agreement"] = _guarded(lambda: release_gate(hf, device, ctx))
            if label == "hisparse":
                gate = _guarded(lambda: _hisparse_float32(hf, device, args.hisparse_gate_ctx,
                                                          args.hisparse_rows))
                row.update(_hisparse_agreements(engine_with, prompt, ours, row.pop("agreement"), gate))
            return row

        result[label] = _guarded(variant)
        save()
        print(label, result[label].get("step_ms"), result[label].get("error", ""), flush=True)
    # Headline ratios only from a run whose correctness checks passed.
    gate_ratios(result, contexts[0])
    save()
    return result


def _hisparse_agreements(engine_with: Any, prompt: list[int], ours: tuple[list[int], list[float]],
                         vs_general: dict[str, Any], gate: dict[str, Any]) -> dict[str, Any]:
    """The gate is `gate` (`_hisparse_float32`); beside it, for the record, the bf16 agreements:
    HiSparse on the fixed-shape step against the same step without HiSparse, against the HiSparse
    general step, and the fixed-shape step's own agreement with the general step without HiSparse
    (two kernel paths in bf16 over one long context)."""
    fixed = engine_with(decode="on")
    off_fixed = _greedy_with_logprobs(fixed, prompt)
    _release(fixed)
    general = engine_with(decode="off")
    off_general = _greedy_with_logprobs(general, prompt)
    _release(general)
    return {"agreement": gate, "bf16_vs_fixed_off": _agreement(ours, off_fixed),
            "bf16_vs_hisparse_general": vs_general,
            "bf16_calibration_fixed_vs_general_off": _agreement(off_fixed, off_general)}


def _float32_run(hf_model: Any, device: str, ctx: int, decode: str,
                 **kwargs: Any) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs in float32: dense weights holding the packed values exactly, every
    prefill on the PyTorch general step, so that engines differing only in `decode` (the fixed-shape
    step or the general one) decode one prefill.

    In bf16 two right paths of this slice part at near-ties and differ by up to ~0.14 in logprob
    (exact numerics, fixed-shape against general at 4K: results/2026-12-02-h200-decode-agreement*),
    which hides any bug smaller than that; in float32 they agree to ~1e-5."""
    engine = build_engine(hf_model, device, "float32", max_model_len=ctx + 256, max_num_seqs=2,
                          num_virtual_tokens=2 * ctx + 8192, decode=decode, dense=True, general_kernels="off",
                          **kwargs)
    prompt = _prompts(hf_model.config.vocab_size, 1, ctx, seed=ctx + 1, shared=0)[0]
    run = _greedy_with_logprobs(engine, prompt)
    _release(engine)
    return run


def _float32_row(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]], ctx: int,
                 bound: float | None = None) -> dict[str, Any]:
    row = _agreement(ours, theirs)
    row.update(ctx=ctx, dtype="float32", ok=row["leading_tokens_agree"] == row["of"]
               and row["max_logprob_diff"] < (FLOAT32_BOUND if bound is None else bound),
               logprob_diffs=[abs(a - b) for a, b in zip(ours[1], theirs[1], strict=True)])
    return row


def _hisparse_float32(hf_model: Any, device: str, ctx: int, hisparse_rows: int) -> dict[str, Any]:
    """HiSparse's float32 gate, and beside it what tells a HiSparse fault from the fixed-shape step's
    own spread against the general step at this context:
    * `agreement` (the gate): HiSparse's fixed-shape step against its general step (host-side
      page-ins), all AGREE_TOKENS tokens within FLOAT32_BOUND;
    * `fixed_vs_general_off`: the same pair of steps without HiSparse;
    * `hisparse_vs_off_fixed`: the fixed-shape step with and without HiSparse. Both run the same
      kernels on the same prefill (the PyTorch general step's), and paging only moves rows, so they
      must agree to PAGING_BOUND; it is part of the gate.
    The gate passes when paging agrees and either HiSparse's two steps agree within FLOAT32_BOUND or
    they part exactly as the two steps without HiSparse do (`same_spread_as_off`: the same tokens, every
    token's difference within PAGING_BOUND of the other pair's). That second case is a spread of the
    fixed-shape step against the general step at this prompt, which HiSparse leaves as it finds it (the
    H200 run at 5d043a7: one token of 16 at 1.6e-3 in both pairs, the rest within 5e-6). Per-token
    differences are kept (`logprob_diffs`) to show where two paths part."""
    hisparse = {"hisparse_rows": hisparse_rows}
    runs = {(decode, name): _float32_run(hf_model, device, ctx, decode, **extra)
            for name, extra in (("hisparse", hisparse), ("off", {})) for decode in ("on", "off")}
    gate = _float32_row(runs[("on", "hisparse")], runs[("off", "hisparse")], ctx)
    paging = _float32_row(runs[("on", "hisparse")], runs[("on", "off")], ctx, bound=PAGING_BOUND)
    off = _float32_row(runs[("on", "off")], runs[("off", "off")], ctx)
    gate.update(fixed_vs_general_off=off, hisparse_vs_off_fixed=paging, vs_general_ok=gate["ok"],
                same_spread_as_off=same_spread(gate, off))
    gate["ok"] = paging["ok"] and (gate["vs_general_ok"] or gate["same_spread_as_off"])
    return gate


def same_spread(ours: dict[str, Any], off: dict[str, Any]) -> bool:
    """Two float32 agreement rows part alike: as many leading tokens, each token's logprob difference
    within PAGING_BOUND of the other's."""
    return ours["leading_tokens_agree"] == off["leading_tokens_agree"] == ours["of"] and all(
        abs(a - b) <= PAGING_BOUND for a, b in zip(ours["logprob_diffs"], off["logprob_diffs"], strict=True))


# The fixed-shape step with and without HiSparse: one computation on rows that paging moved, not changed.
PAGING_BOUND = 1e-6
FLOAT32_BOUND = 1e-3


def gate_ratios(result: dict[str, Any], ctx: int) -> None:
    """Headline ratios only from checks that passed: the run's checks (tiny GPU = CPU, logits against
    transformers, every timed batch running) gate every ratio; a variant's agreement with the path it
    replaces gates that variant's ratios. The rest are kept apart under `ratios_unchecked`."""
    result["checks_ok"] = _checks_ok(result)
    _ratios(result, ctx)
    failed = [label for label in ("release", "hisparse")
              if label in result and not result[label].get("agreement", {}).get("ok", False)]
    unchecked = {key: value for key, value in result["ratios"].items()
                 if not result["checks_ok"] or any(key.startswith(f"engine_{label}_") for label in failed)}
    result["ratios_unchecked"] = unchecked
    result["ratios"] = {key: value for key, value in result["ratios"].items() if key not in unchecked}
    result["variant_checks_failed"] = failed


def _release(engine: Any) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


AGREE_TOKENS = 16


def _greedy_with_logprobs(engine: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """AGREE_TOKENS greedy tokens after `prompt` (nothing cached) and each one's logprob."""
    from antumbra import SamplingParams

    engine.clear_cache()
    out = engine.generate([prompt], SamplingParams(max_tokens=AGREE_TOKENS, temperature=0.0, ignore_eos=True,
                                                   logprobs=0))[0]
    return list(out.token_ids), [step[t] for step, t in zip(out.logprobs, out.token_ids, strict=True)]


def _agreement(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> dict[str, Any]:
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


def _checks_ok(result: dict[str, Any]) -> bool:
    tiny = result.get("tiny_gpu_vs_cpu")
    logits = result.get("logits_vs_transformers", {})
    # Every timed decode ran its whole batch (no request preempted or waiting during the timing).
    batches_ok = all(row.get("all_running", True) and "error" not in row
                     for key, row in result.get("engine", {}).items() if key.startswith("decode_"))
    return (tiny is None or bool(tiny.get("all_identical"))) and bool(logits.get("same_argmax")) and \
        logits.get("rel_err", 1.0) < 0.05 and batches_ok


def _ratios(result: dict[str, Any], ctx: int) -> None:
    ours = result["engine"].get(f"decode_B1_ctx{ctx}", {})
    theirs = result["transformers"].get(f"B1_ctx{ctx}", {})
    bw = result.get("copy_gbps")
    ratios = result["ratios"]
    if "step_ms" in ours and "step_ms" in theirs:
        ratios[f"engine_decode_vs_transformers_B1_ctx{ctx}"] = theirs["step_ms"] / ours["step_ms"]
    if "step_ms" in ours and bw:
        floor_ms = ours["floor"]["total_bytes"] / (bw * 1e9) * 1e3
        ratios[f"engine_decode_vs_floor_B1_ctx{ctx}"] = floor_ms / ours["step_ms"]
        ours["floor"]["floor_ms"] = floor_ms
        if ours.get("graph_replay_ms"):
            ratios[f"engine_graph_vs_floor_B1_ctx{ctx}"] = floor_ms / ours["graph_replay_ms"]
    if ours.get("graph_replay_ms") and ours.get("graph_replay_ms_overlap_indexer"):
        # Above 1: the indexer on a second stream shortens the step (FastPathConfig.overlap_indexer).
        ratios[f"engine_overlap_indexer_gain_B1_ctx{ctx}"] = (
            ours["graph_replay_ms"] / ours["graph_replay_ms_overlap_indexer"]
        )
    for key, value in result["engine"].items():
        if key.startswith("prefill") and "s" in value:
            ratios[f"engine_{key}_s"] = value["s"]
    from .engine_round2 import ratios as round_two

    ratios.update(round_two(result, ctx))


def merge_into_daily(result: dict[str, Any], name: str) -> None:
    """Copy the engine's ratios and figures into today's `<date>-<device>.json`, beside the kernels'
    (refused when that file holds another commit's figures)."""
    from .common import RESULTS_DIR, CommitMismatch

    path = RESULTS_DIR / f"{result['date']}-{name}.json"
    daily = (
        json.loads(path.read_text()) if path.exists() else {k: result[k] for k in ("date", "device", "torch")}
    )
    if daily.get("commit") not in (None, result.get("commit")):
        raise CommitMismatch(f"{path} holds commit {daily['commit']}; this run is {result.get('commit')}")
    daily["commit"] = result.get("commit")
    daily.setdefault("ratios", {}).update(result["ratios"])
    kept = ("engine", "transformers", "tiny_gpu_vs_cpu", "logits_vs_transformers", "copy_gbps",
            "matmul_tflops", "slice", "params", "triton", "transformers_version", "checks_ok")
    daily["engine_gpu"] = {k: result.get(k) for k in kept}
    daily["engine_gpu_vs_cpu"] = result.get("tiny_gpu_vs_cpu", daily.get("engine_gpu_vs_cpu"))
    daily["targets"] = summarize(daily)
    path.write_text(json.dumps(daily, indent=2) + "\n")


def _guarded(fn: Any) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # one failing configuration must not hide the others' figures
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
        # A compiler's message follows the kernel's source: keep its end too.
        return {"error": repr(exc)[:500], "error_end": str(exc)[-1500:],
                "traceback": traceback.format_exc()[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="small widths; runs on CPU in the interpreter")
    parser.add_argument("--contexts", default="4096,65536")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--steps", type=int, default=20)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--long-batches", type=ints, default=[1, 8],
                        help="batches at the contexts after the first")
    parser.add_argument("--prefill-extra", type=ints, default=[16384],
                        help="prefills timed on the longest engine")
    parser.add_argument("--prefill-chunk-alt", type=int, default=2048,
                        help="also time the 16K prefill in steps of this many tokens (0: skip)")
    parser.add_argument("--release-ctx", type=int, default=4096, help="0: skip the release-numerics engine")
    parser.add_argument("--hisparse-ctx", type=int, default=65536, help="0: skip the HiSparse engine")
    parser.add_argument("--hisparse-rows", type=int, default=2048)
    parser.add_argument("--hisparse-gate-ctx", type=int, default=16384,
                        help="context of HiSparse's float32 agreement check (more C4 rows than hot rows)")
    parser.add_argument("--no-tiny", action="store_true")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="kernel breakdown of each timed prefill (torch.profiler)")
    parser.add_argument("--no-graphs", action="store_true", help="fixed-shape decode steps run eagerly")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="also time B > 1 with rows sharing all but 32 tokens of their context")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    if not args.smoke and torch.cuda.is_available() and "H200" in result["device"]:
        merge_into_daily(result, "h200")
    print(
        json.dumps(
            {
                "ratios": result["ratios"],
                "tiny": result.get("tiny_gpu_vs_cpu", {}).get("all_identical"),
                "logits": result.get("logits_vs_transformers"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
