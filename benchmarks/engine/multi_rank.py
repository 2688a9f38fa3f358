"""One replica over N ranks (tensor x expert parallel) against the same engine on one rank.

The same code runs everywhere: on 1 GPU (`--tp 1 --ep 1`, the one-rank engine, as the baseline),
on N GPUs of one node (`--tp T --ep E`: rank 0 here, the others Ray actors in one placement
group, NCCL), and on a CPU at tiny size (`--device cpu --tiny`, gloo), so it can be checked
anywhere. One run measures:
* greedy agreement of the N-rank replica with the one-rank engine over 64 tokens;
* decode step time at each batch x context, every sequence an independent context (no shared
  prefix), with the time rank 0 spends in collectives per step;
* prefill time of one prompt per prefill length;
* the byte floor of a decode step per rank (rank 0's weights touched + the KV rows read), and the
  bytes each rank holds and its peak resident memory after loading.

    python -m benchmarks run engine --only multi_rank --set tp=2 --set ep=1   # 2 GPUs, the slice
    python -m benchmarks run engine --only multi_rank --smoke --set tp=2 --set ep=2   # CPU, tiny, gloo

The checkpoint is written once in the release layout (FP8 linears, MXFP4 experts), so every
rank streams its shard from disk: a V4-Flash-width 4-layer slice on CUDA, the tiny model in a smoke
run. Options: tp, ep, checkpoint (where the generated checkpoint goes, reused when present), batches,
contexts, prefill, steps.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..lib.context import Context
from ..lib.decode_floor import decode_floor_bytes
from ..lib.slices import SMOKE_SLICE, SliceSpec, build_hf, free_engine
from ..lib.timing import sync

DEVICE = "cuda"


def make_checkpoint(out: Path, tiny: bool, device: str) -> Path:
    """A release-layout checkpoint: the tiny model, or a V4-Flash-width slice with random weights."""
    from antumbra.replicas.model.release_format import save_release_checkpoint

    if (out / "config.json").exists():
        return out
    mtp = None
    if tiny:
        from antumbra.replicas.model.tiny import TinyModelSpec, build_model, mtp_tensors

        tiny_spec = TinyModelSpec(seed=5, moe_intermediate_size=64)
        model, mtp = build_model(tiny_spec), mtp_tensors(tiny_spec)
    else:
        spec: SliceSpec = SliceSpec() if device.startswith("cuda") else SMOKE_SLICE
        model = build_hf(spec, device, torch.bfloat16)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    save_release_checkpoint(state, model.config, out, mtp_state_dict=mtp, shard_size_bytes=1 << 30)
    del model, state
    gc.collect()
    return out


def _engine(path: Path, args: Any, tp: int, ep: int) -> Any:
    from antumbra import Engine
    from antumbra.config import CacheConfig, SchedulerConfig

    longest = max(args.contexts + args.prefill) + args.steps + 64
    batch = max(args.batches)
    return Engine.from_pretrained(
        path, device=args.device, dtype=args.dtype, tensor_parallel_size=tp, expert_parallel_size=ep,
        scheduler=SchedulerConfig(max_num_seqs=batch, max_model_len=longest,
                                  max_num_batched_tokens=args.chunk),
        cache=CacheConfig(num_virtual_tokens=(batch + 1) * longest), warmup="off", progress=False,
    )


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(vocab, 250), (n,), generator=g).tolist()


def greedy(engine: Any, prompt: list[int], n: int) -> list[int]:
    from antumbra import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def decode_point(engine: Any, batch: int, ctx: int, steps: int, device: str) -> dict[str, Any]:
    """ms per decode step with `batch` independent `ctx`-token contexts decoding."""
    from antumbra import SamplingParams

    engine.clear_cache()
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.core.add_request(_tokens(vocab, ctx, seed=100 + b), params) for b in range(batch)]
    while any(not engine.core.requests[r].output_token_ids for r in ids):
        engine.core.step()
    engine.core.step()
    comm = engine.gang.comm if engine.gang is not None else None
    before = comm.seconds if comm else 0.0
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.core.step()
    sync(device)
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    collective_ms = ((comm.seconds - before) * 1e3 / steps) if comm else 0.0
    for r in ids:
        engine.core.abort(r)
    floor = decode_floor_bytes(engine, batch, ctx)
    return {"batch": batch, "context": ctx, "step_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms,
            "collective_ms_per_step": collective_ms, "floor_bytes_rank0": floor["total_bytes"]}


def prefill_point(engine: Any, length: int, device: str) -> dict[str, Any]:
    engine.clear_cache()
    prompt = _tokens(engine.model_config.vocab_size, length, seed=7)
    sync(device)
    start = time.perf_counter()
    greedy(engine, prompt, 1)
    sync(device)
    seconds = time.perf_counter() - start
    return {"prompt_tokens": length, "prefill_s": seconds, "tokens_per_s": length / seconds}


@dataclass(frozen=True)
class Settings:
    device: str
    tiny: bool
    tp: int
    ep: int
    checkpoint: str
    batches: list[int]
    contexts: list[int]
    prefill: list[int]
    steps: int
    dtype: str
    chunk: int
    agreement_tokens: int

    @classmethod
    def of(cls, ctx: Context) -> Settings:
        tiny = ctx.smoke
        return cls(device=ctx.device, tiny=tiny, tp=ctx.option("tp", 1), ep=ctx.option("ep", 1),
                   checkpoint=ctx.option("checkpoint", ""),
                   batches=ctx.option("batches", [1, 2] if tiny else [1, 8, 32]),
                   contexts=ctx.option("contexts", [128] if tiny else [4096, 16384]),
                   prefill=ctx.option("prefill", [256] if tiny else [16384, 65536]),
                   steps=ctx.option("steps", 2 if tiny else 64),
                   dtype="bfloat16" if ctx.on_gpu else "float32", chunk=512 if tiny else 8192,
                   agreement_tokens=8 if tiny else 64)


def run(ctx: Context) -> dict[str, Any]:
    import ray

    args = Settings.of(ctx)
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False,
                 num_cpus=max(4, 2 * args.tp * args.ep) if args.device == "cpu" else None)
    try:
        return _measure(args)
    finally:
        if started:
            ray.shutdown()


def _measure(args: Settings) -> dict[str, Any]:
    kind = "tiny" if args.tiny else "slice"
    work = Path(args.checkpoint or Path(tempfile.gettempdir()) / f"antumbra-multi-{kind}")
    path = make_checkpoint(work, args.tiny, args.device)
    prompt = _tokens(512, 200, seed=3)
    parallel = args.tp * args.ep > 1
    engine = one = _engine(path, args, 1, 1)
    reference = greedy(one, prompt, args.agreement_tokens)
    if parallel:  # the one-rank engine gives its device back before the ranks load
        del engine
        free_engine(one)
        engine = _engine(path, args, args.tp, args.ep)
    try:
        tokens = greedy(engine, prompt, args.agreement_tokens)
        pairs = enumerate(zip(tokens, reference, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(tokens))
        decode = [decode_point(engine, b, c, args.steps, args.device)
                  for c in args.contexts for b in args.batches]
        prefill = [prefill_point(engine, n, args.device) for n in args.prefill]
        ranks = engine.gang.loads if engine.gang is not None else []
        if engine.gang is not None:
            live = {int(s["rank"]): s for s in engine.gang.stats()}
            for row in ranks[1:]:
                row["collective_s_total"] = live[row["rank"]]["collective_s"]
    finally:
        engine.shutdown()
    return {
        "tp": args.tp, "ep": args.ep, "world_size": args.tp * args.ep, "tiny": args.tiny,
        "checkpoint": str(path), "dtype": args.dtype,
        "agreement": {"tokens": args.agreement_tokens, "first_divergence": same,
                      "identical": tokens == reference},
        "decode": decode, "prefill": prefill, "ranks": ranks,
    }
