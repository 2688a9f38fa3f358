"""The suites `python -m benchmarks run SUITE` runs, and how one suite run goes.

A suite is a list of benchmark modules. Each module has `run(ctx: Context) -> dict` (its section of
the results file), and may state `DEVICE` ("cuda": meaningful on a GPU only, run on a CPU only as a
smoke check; "cpu": always on the CPU; absent: wherever the suite runs) and `HEADLINE` /
`HEADLINE_PREFIXES` (which of its keys are the suite's headline ratios; a module may instead return
them under `ratios`). One module that fails is recorded with its error and the others still run.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .lib.context import Context
from .lib.records import ResultsFile
from .lib.targets import summarize
from .lib.timing import guarded


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    benchmarks: tuple[str, ...]  # modules under benchmarks/, dotted
    cpu_only: bool = False  # runs on the CPU whatever the machine has (and interprets the kernels)


SUITES = {s.name: s for s in (
    Suite("kernels", "every Triton kernel against its byte / FLOP floor and the PyTorch chain it replaces",
          tuple(f"kernels.{m}" for m in ("attention", "topk", "compressor", "mhc", "moe", "fp8_linear",
                                         "norm_rope", "decode_index", "dequant", "indexer_prefill",
                                         "attention_fp8", "launch_chain", "gemv"))),
    Suite("engine", "the engine on the V4-Flash slice against transformers and its floors; HiSparse's "
          "prefill and decode against HiSparse off; the decode "
          "step on V4-Flash's 256 experts against its floor; sampling, "
          "batch-invariant mode, several ranks, cold starts; the tiny engine against transformers on a CPU; "
          "a distilled MTP draft block's accept length",
          ("engine.slice", "engine.hisparse_prefill", "engine.real_moe", "engine.sampling",
           "engine.structured", "engine.deterministic_slice", "engine.multi_rank",
           "engine.cold_start", "engine.tiny_vs_transformers", "engine.deterministic_tiny",
           "engine.mtp_accept", "engine.spec_decode", "engine.mixed_step")),
    Suite("decode-ab", "the decode step of this tree against another engine build (--set baseline=DIR)",
          ("engine.decode_ab",)),
    Suite("cache", "prefix caching and SWA replay on the tiny engine; block hashing of long prompts",
          ("cache.prefix_cache", "cache.block_hash")),
    Suite("platform", "the served platform: routers compared, the prefix directory failing, autoscaling, "
          "prefill / decode disaggregation, the platform against the engine on a GPU, the replica's GIL "
          "switch interval on a CPU",
          ("serving.routing", "serving.directory_failure", "serving.autoscaling", "serving.disaggregation",
           "serving.platform_vs_engine", "serving.replica_gil",
           "serving.replica_process")),
    Suite("reliability", "mixed multi-tenant load with a fault every minute: nothing lost, memory bounded",
          ("reliability.soak",)),
    Suite("tuning", "launch-shape sweeps of the attention, top-k and MoE kernels", ("kernels.tune",)),
    Suite("compile", "every kernel launch of the tiny engines compiled for sm_90 without a GPU",
          ("kernels.compile_sm90",), cpu_only=True),
    Suite("gpu-tests", "the GPU-marked tests (skipped without a GPU), their outcomes recorded",
          ("gpu_tests",)),
)}


def run_suite(suite: Suite, device: str, smoke: bool, only: list[str], options: dict[str, str],
              results_dir: Path | None = None) -> ResultsFile:
    if device == "cpu":
        # Kernels run in the interpreter on a CPU; this must be set before they are defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    results = ResultsFile(suite.name, device, smoke, results_dir)
    for dotted in suite.benchmarks:
        name = dotted.rsplit(".", 1)[-1]
        if only and name not in only:
            continue
        start = time.perf_counter()
        module, section = _run_one(dotted, device, smoke, options)
        section["wall_s"] = time.perf_counter() - start
        results.put(name, section, headline(module, section))
        print(f"{suite.name}/{name}: {section['wall_s']:.1f} s"
              + (f", {section['error']}" if "error" in section else "")
              + (f", {section['skipped']}" if "skipped" in section else ""), flush=True)
    results.data["targets"] = summarize(results.data["ratios"])
    results.save()
    return results


def _run_one(dotted: str, device: str, smoke: bool, options: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """-> (the module or None, its section): its figures, why it was skipped, or its error."""
    try:
        module = importlib.import_module(f"benchmarks.{dotted}")
    except Exception as exc:  # recorded like any failure; the suite's other benchmarks still run
        return None, {"error": f"import failed: {exc!r}"}
    where = getattr(module, "DEVICE", device)
    if where == "cuda" and not device.startswith("cuda") and not smoke:
        return module, {"skipped": "needs a CUDA device (a CPU runs it with --smoke)"}
    ctx = Context(device=device if where != "cpu" else "cpu", smoke=smoke, options=options)
    section = guarded(lambda: module.run(ctx))
    section["device"] = ctx.device
    return module, section


def headline(module: Any, section: dict[str, Any]) -> dict[str, float]:
    """The section's headline ratios: its `ratios`, and its keys the module names in HEADLINE /
    HEADLINE_PREFIXES."""
    ratios = dict(section.get("ratios", {}))
    ratios.update({k: section[k] for k in getattr(module, "HEADLINE", ()) if section.get(k) is not None})
    prefixes = getattr(module, "HEADLINE_PREFIXES", ())
    ratios.update({k: v for k, v in section.items() if prefixes and k.startswith(prefixes)})
    return ratios
