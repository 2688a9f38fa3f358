"""Speculative decoding's decode speed on the V4-Flash slice: with its distilled MTP block drafting, and
against the accept length with replayed drafts.

The slice with an MTP block (`slice_checkpoint.cached_slice(..., mtp=True)`: the block drawn at random
and distilled on the device on the target's own greedy text, before anything is timed) is served by
`Engine.from_pretrained` as the decode figures run it (MXFP4 experts, FP8 linears, graphs), built with
`speculative_tokens=3` and `speculative_max_batch` at the largest batch run. At batch 1 / 8 / 32 over
cached prompts a decode step is what the public API shows (`lib/api_steps.py`: `generate` of 1 and
1 + N tokens); first without speculation (turned off on the same engine), whose greedy tokens become
each prompt's reference, then with each drafter:

- `mtp`: the engine's own MTP drafter. Its accept length comes from the responses' counts
  (`num_drafted_tokens`, `num_accepted_tokens`) over one greedy run of the batch: tokens emitted per
  verify step, the correction / bonus token included. By default (`distill=timed`) the block is
  distilled on the target's continuations of the very prompts timed: a random-weight target has no
  language a draft could generalise over (a block distilled on other prompts drafts far worse on new
  ones), and what the ratios measure is the engine's speed
  with the real drafter's work at a high accept length, which they report beside it. Those
  continuations are the served text: an engine of the same settings without the draft block (on the
  slice without one: the same target) runs each batch's prompts as the timed plain runs do, K tokens
  further (`_served_text`), and distillation trains on its tokens. The random slice's logits are near
  ties, so its text at another batch size or in another numerics mode rounds otherwise, and a block
  that learnt one text drafts little of another; `batches.<b>.served_text_equals_plain` says whether
  that engine's text was the timed plain run's. `distill=random` distils on random prompts instead
  (`slice_checkpoint.distill_config`): a held-out accept length.
- `replay`: k = 3 drafts replayed from the reference (`speculative.replay.ReplayDrafter`), each kept
  with probability r: the chart of tokens/s against the accept length r makes (1 + r + r^2 + r^3 when
  every kept draft is accepted). The replayed drafts cost no forward, so the chart shows the target's
  side of speculation: verify steps of k + 1 positions per request, and the host's work around them.

Ratios (plain step ms / speculating ms per token): `spec_speedup_B{b}` with the MTP drafter and
`spec_accept_length_k3` its accept length at the smallest batch (each batch's under `batches`, all
batches' together in `mtp_accept_length_all_batches`); `spec_replay_speedup_B{b}` at keep rate `rate`
(default 0.8, an accept length near 2.95 at k = 3) and `spec_replay_accept_length_B1` the accept length
measured there. `speculative_max_batch_measured`: the largest batch up to which the MTP drafter sped
every batch run up (`speculation_threshold`), what the engine's default threshold is to be chosen
from. The check gating a batch's ratios: its speculating runs' greedy tokens agree with the plain
run's, equal or parting only where the plain run ranks both tokens within a rounding tie
(`spec_parting.py`, each parting recorded under `partings`); the others go to `ratios_unchecked`. The
section also records how the slice's block was written and distilled (`slice`: seconds, first / last
loss; read from the cached checkpoint when it was made earlier).

    python -m benchmarks run engine --only spec_decode [--set batches=1,8,32] [--set drafter=mtp] [--smoke]

Options: drafter (`mtp`, `replay` or both, `mtp,replay`, the default), distill (`timed` or `random`, as
above; a cached MTP slice distilled otherwise is written again), batches, max_batch (the engine's
`speculative_max_batch`; default the largest batch), rates, rate, ctx, new_tokens, reps, warmup, decode
(`off`: plain decoding on the general step too), parts (`on`: after each timed speculating run, one more
run with the device drained around each part of a speculating step, the verify forward, the rejection
rule and the drafter, reported as ms per step under `parts_ms`; that run is not timed as a whole),
token_map (`on`: the drafter scores only the token map distillation wrote, `draft_vocab.json`: the
target's most frequent continuation tokens, against the whole vocabulary's head by default), gate
(`measured`: the engine's speculation gate that measures speculating against plain steps per batch
bucket, `SpeculativeConfig.gate`; default `fixed`, the cap alone), profile (`on`: after each MTP run,
the device's time of each graph a speculating step uses against the step's wall time, and the host's
time per function, `spec_profile.py`, under `profile`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ..lib.api_steps import api_decode_step_ms
from ..lib.context import Context
from ..lib.slices import SMOKE_SLICE, SliceSpec, prompts
from ..lib.timing import Parts, sync
from .spec_parting import agreement, plain_logprobs
from .spec_profile import speculation_profile

DEVICE = "cuda"
RATES = (0.0, 0.5, 0.8, 0.9, 1.0)
K = 3


def speculation_threshold(speedups: dict[int, float], floor: float = 1.0) -> int:
    """The `speculative_max_batch` a measurement supports: the largest batch run below which every
    measured batch, and it, sped up by at least `floor` with the MTP drafter (0: none did)."""
    threshold = 0
    for batch in sorted(speedups):
        if speedups[batch] < floor:
            break
        threshold = batch
    return threshold


def _engine(ctx: Context, path: Path, max_batch: int, max_len: int, spec_max_batch: int,
            speculative_tokens: int = K) -> Any:
    from antumbra import Engine
    from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig

    # `--set decode=off`: plain decoding on the general step too, the path verify chunks take, so that
    # greedy tokens compare like with like (the captured decode step rounds differently in bfloat16).
    decode = ctx.option("decode", "auto")
    # Graph sizes up to the verify rows of the largest batch (k + 1 rows a request).
    sizes = tuple(b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256) if b <= max_batch * (K + 1))
    fast = FastPathConfig(decode=decode, cuda_graph_batch_sizes=sizes) if ctx.smoke else FastPathConfig(
        expert_format="mxfp4", linear_format="fp8", decode=decode, cuda_graph_batch_sizes=sizes)
    return Engine.from_pretrained(
        path, device=ctx.device, dtype="float32" if ctx.smoke else "bfloat16",
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_model_len=max_len),
        cache=CacheConfig(num_virtual_tokens=(max_batch + 2) * max_len), fast=fast,
        warmup=ctx.option("warmup", "off" if ctx.smoke else "auto"),
        speculative_tokens=speculative_tokens, speculative_max_batch=spec_max_batch,
        speculative_token_map=_token_map(ctx, path) if speculative_tokens else None,
        speculative_gate=ctx.option("gate", "fixed"),
    )


def _served_text(ctx: Context, by_batch: dict[int, list[list[int]]], max_len: int, new_tokens: int,
                 spec_max_batch: int) -> dict[int, list[list[int]]]:
    """Each batch's greedy text as the timed plain runs make it (the same engine settings and calls,
    K tokens further), from the slice without a draft block (the same target): what `distill=timed`
    trains the block on."""
    import gc

    import torch

    from .slice_checkpoint import cached_slice

    engine = _engine(ctx, cached_slice(ctx.device, ctx.smoke), max(by_batch), max_len, spec_max_batch,
                     speculative_tokens=0)
    try:
        return {b: api_decode_step_ms(engine, ps, new_tokens + K, 1, ctx.device)["token_ids"]
                for b, ps in by_batch.items()}
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _token_map(ctx: Context, path: Path) -> str | None:
    """`--set token_map=on`: the drafter scores the token map distillation wrote beside the block."""
    from antumbra.replicas.speculative.draft_vocab import TOKEN_MAP_FILE

    return str(path / TOKEN_MAP_FILE) if ctx.option("token_map", "off") == "on" else None


class _Modes:
    """Speculation on the one engine turned off, back to its MTP drafter, or to replayed drafts."""

    def __init__(self, engine: Any) -> None:
        self.core = engine.core
        self.engine = engine
        # The MTP drafter the engine was built with, and its config.
        self.mtp = (self.core.runner.speculation, self.core.config.speculative)

    def plain(self) -> None:
        self.core.runner.speculation = None
        self.core.scheduler.speculative = None

    def mtp_drafts(self) -> None:
        self.core.enable_speculation(*self.mtp)

    def replay(self, references: dict[tuple[int, ...], list[int]], rate: float) -> None:
        _speculate(self.engine, references, rate, self.mtp[1])


def _speculate(engine: Any, references: dict[tuple[int, ...], list[int]], rate: float, config: Any) -> None:
    """Turn on replayed speculation at keep rate `rate` (k = K) for every request of `engine`, under
    `config` (a `SpeculativeConfig`)."""
    from antumbra.replicas.speculative.engine_step import MTPSpeculation
    from antumbra.replicas.speculative.replay import ReplayDrafter

    core = engine.core

    def reference_of(request_id: str) -> list[int] | None:
        request = core.requests.get(request_id)
        return references.get(tuple(request.prompt_token_ids)) if request is not None else None

    drafter = ReplayDrafter(reference_of, K, rate, engine.model_config.vocab_size, core.device)
    core.enable_speculation(MTPSpeculation(drafter, engine.eos_token_ids), config)


def _parts_ms(engine: Any, batch_prompts: list[list[int]], new_tokens: int, device: str) -> dict[str, Any]:
    """One greedy run with the parts of each step timed (`Parts`, the device drained around each): the
    whole step, the forward of a speculating step (fixed-shape rows or the general step), the rejection
    rule and the drafter."""
    from antumbra import SamplingParams

    core = engine.core
    runner, speculation = core.runner, core.runner.speculation
    parts = Parts(lambda: sync(device))
    drafter = speculation.drafter
    saved = [(core, "step", core.step), (runner, "run", runner.run),
             (speculation, "_verify", speculation._verify), (drafter, "draft", drafter.draft)]
    names = {"step": "engine_step", "run": "forward", "_verify": "rejection_rule", "draft": "drafter"}
    for owner, attr, fn in saved:
        setattr(owner, attr, parts.wrap(names[attr], fn))
    try:
        engine.generate(batch_prompts, SamplingParams(max_tokens=1 + new_tokens, temperature=0.0,
                                                      ignore_eos=True))
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    return parts.mean_ms()


def _timed_speculation(engine: Any, batch_prompts: list[list[int]], new_tokens: int, reps: int, device: str,
                       plain_ms: float, references: dict[tuple[int, ...], list[int]],
                       reference_logprobs: dict[tuple[int, ...], Any], parts: bool, profile: bool = False
                       ) -> dict[str, Any]:
    """One speculating configuration (already turned on) at one batch: its counts over a greedy run,
    then its timed runs, against the plain step and the reference tokens."""
    drafted, accepted = _counts(engine, batch_prompts, new_tokens)
    run = api_decode_step_ms(engine, batch_prompts, new_tokens, reps, device)
    tokens = run.pop("token_ids")
    steps = drafted / K if drafted else 0.0
    out = {"ms_per_token": run["step_ms"], "speedup": plain_ms / run["step_ms"],
           "accept_length": (accepted + steps) / steps if steps else 1.0, "drafted": drafted,
           "accepted": accepted, **agreement(references, reference_logprobs, batch_prompts, tokens),
           "run": run}
    gate = engine.core.scheduler.speculation_gate
    if gate is not None:  # the measured gate's decisions and means, every bucket so far
        out["gate"] = {str(bucket): one for bucket, one in gate.summary().items()}
    if parts:
        out["parts_ms"] = _parts_ms(engine, batch_prompts, new_tokens, device)
    if profile:
        out["profile"] = speculation_profile(engine, batch_prompts, K, device)
    return out


def _one_batch(modes: _Modes, spec: SliceSpec, batch: int, ctx_len: int, new_tokens: int, reps: int,
               device: str, drafters: list[str], rates: tuple[float, ...],
               parts: bool = False, served: list[list[int]] | None = None, profile: bool = False
               ) -> dict[str, Any]:
    engine = modes.engine
    batch_prompts = prompts(spec.vocab_size, batch, ctx_len, seed=batch)
    modes.plain()
    plain = api_decode_step_ms(engine, batch_prompts, new_tokens, reps, device)
    tokens = plain.pop("token_ids")
    references = {tuple(p): t for p, t in zip(batch_prompts, tokens, strict=True)}
    logged = plain_logprobs(engine, batch_prompts, new_tokens)  # untimed: judges where a run parts
    reference_logprobs = {tuple(p): (t, lp) for p, t, lp in zip(batch_prompts, *logged, strict=True)}
    out: dict[str, Any] = {"plain_step_ms": plain["step_ms"], "plain": plain}
    if served is not None:  # the text the block was distilled on, against this run's
        out["served_text_equals_plain"] = all(s[: len(t)] == t for s, t in zip(served, tokens, strict=True))
    _progress({"batch": batch, "plain_step_ms": plain["step_ms"]})
    for drafter in drafters:
        if drafter == "mtp":
            modes.mtp_drafts()
            out["mtp"] = _timed_speculation(engine, batch_prompts, new_tokens, reps, device, plain["step_ms"],
                                            references, reference_logprobs, parts, profile)
            _progress({"batch": batch, "drafter": "mtp", **_figures(out["mtp"])})
            continue
        out["rates"] = {}
        for rate in rates:
            modes.replay(references, rate)
            one = _timed_speculation(engine, batch_prompts, new_tokens, reps, device, plain["step_ms"],
                                     references, reference_logprobs, parts)
            out["rates"][str(rate)] = one
            _progress({"batch": batch, "drafter": "replay", "rate": rate, **_figures(one)})
    modes.plain()
    return out


def _figures(one: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in one.items() if k not in ("run", "parts_ms", "profile")}


def _progress(line: dict[str, Any]) -> None:
    """One line per measurement on stderr, so a run cut short by a time limit still tells its figures."""
    print(json.dumps(line), file=sys.stderr, flush=True)


def _counts(engine: Any, batch_prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """Draft tokens verified and accepted over one greedy run of the batch."""
    from antumbra import SamplingParams

    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=1 + new_tokens, temperature=0.0,
                                                          ignore_eos=True))
    return sum(o.num_drafted_tokens for o in outs), sum(o.num_accepted_tokens for o in outs)


def run(ctx: Context) -> dict[str, Any]:
    from .slice_checkpoint import cached_slice, written_record

    spec = SMOKE_SLICE if ctx.smoke else SliceSpec()
    batches = [int(b) for b in str(ctx.option("batches", "1,2" if ctx.smoke else "1,8,32")).split(",")]
    drafters = [d for d in str(ctx.option("drafter", "mtp,replay")).split(",") if d]
    if not drafters or set(drafters) - {"mtp", "replay"}:
        raise ValueError(f"drafter must name mtp, replay or both, got {drafters}")
    ctx_len = int(ctx.option("ctx", 48 if ctx.smoke else 1024))
    new_tokens = int(ctx.option("new_tokens", 6 if ctx.smoke else 64))
    reps = int(ctx.option("reps", 1 if ctx.smoke else 3))
    rate = str(float(ctx.option("rate", 0.8)))
    rates = tuple(float(r) for r in str(ctx.option("rates", ",".join(map(str, RATES)))).split(","))
    spec_max_batch = int(ctx.option("max_batch", max(batches)))
    # The checkpoint (and its block's distillation) before anything is timed: on the prompts timed
    # below, continued as far as the timed runs go (their drafts included), or on random ones.
    distill_on = str(ctx.option("distill", "timed"))
    if distill_on not in ("timed", "random"):
        raise ValueError(f"distill must be timed or random, got {distill_on!r}")
    by_batch = {b: prompts(spec.vocab_size, b, ctx_len, seed=b) for b in batches}
    max_len = ctx_len + new_tokens + 64
    served = _served_text(ctx, by_batch, max_len, new_tokens, spec_max_batch) if distill_on == "timed" else {}
    timed = [p for b in batches for p in by_batch[b]]
    path = cached_slice(ctx.device, ctx.smoke, mtp=True, prompts=timed if distill_on == "timed" else None,
                        continuation=new_tokens + 1 + K if distill_on == "timed" else None,
                        continuations=[t for b in batches for t in served[b]] if served else None)
    engine = _engine(ctx, path, max(batches), max_len, spec_max_batch)
    modes = _Modes(engine)
    result: dict[str, Any] = {"k": K, "ctx": ctx_len, "new_tokens": new_tokens, "rate": rate,
                              "drafters": drafters, "speculative_max_batch": spec_max_batch,
                              "distilled_on": distill_on, "token_map": ctx.option("token_map", "off"),
                              "slice": written_record(path), "batches": {}}
    # (ratio name, value, whether the batch's greedy tokens agree with the plain run's): a batch's
    # ratios are gated by its own check. A verify step's k + 1 rows per request give the bfloat16
    # GEMMs other shapes than a plain step's rows, so near-tied logits of the random slice may round
    # apart: tokens agree where they are equal or part only at such a tie (`spec_parting.py`); the
    # same comparison in float32 (`test_gpu_paths.py`, speculation on the decode graphs) holds token
    # for token.
    gated: list[tuple[str, float, bool]] = []
    checks = {drafter: True for drafter in drafters}
    drafted = accepted = 0
    for batch in batches:
        one = _one_batch(modes, spec, batch, ctx_len, new_tokens, reps, ctx.device, drafters, rates,
                         ctx.option("parts", "off") == "on", served.get(batch),
                         ctx.option("profile", "off") == "on")
        result["batches"][str(batch)] = one
        if "mtp" in one:
            equal = bool(one["mtp"]["tokens_agree"])
            checks["mtp"] &= equal
            gated.append((f"spec_speedup_B{batch}", one["mtp"]["speedup"], equal))
            drafted += one["mtp"]["drafted"]
            accepted += one["mtp"]["accepted"]
            if batch == min(batches):
                steps = one["mtp"]["drafted"] / K
                accept = (one["mtp"]["accepted"] + steps) / steps if steps else 1.0
                gated.append(("spec_accept_length_k3", accept, equal))
        if "rates" in one:
            equal = all(r["tokens_agree"] for r in one["rates"].values())
            checks["replay"] &= equal
            if rate in one["rates"]:
                gated.append((f"spec_replay_speedup_B{batch}", one["rates"][rate]["speedup"], equal))
                if batch == 1:
                    gated.append(("spec_replay_accept_length_B1", one["rates"][rate]["accept_length"], equal))
    if drafted:
        result["mtp_accept_length_all_batches"] = (accepted + drafted / K) / (drafted / K)
    speedups = {b: one["mtp"]["speedup"] for b, one in result["batches"].items() if "mtp" in one}
    if speedups:
        result["speculative_max_batch_measured"] = speculation_threshold(
            {int(b): v for b, v in speedups.items()})
    result["checks"] = checks
    result["checks_passed"] = all(checks.values())
    result["ratios"] = {}
    for name, value, equal in gated:
        result.setdefault("ratios" if equal else "ratios_unchecked", {})[name] = value
    return result
