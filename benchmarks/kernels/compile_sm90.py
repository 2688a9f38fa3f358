"""Compile for sm_90, on a machine without a GPU, every kernel launch that tiny CPU engine runs make.

The CPU interpreter runs kernels as Python, so code the compiler refuses (a plain function called
from a kernel, a constexpr reassigned across unrolled stages) passes every interpreter test and
fails on the GPU at its first launch (both have happened). Triton compiles
for a GPU target without a GPU, down to the cubin. This records every launch of the project's
kernels during tiny engine runs on the CPU (exact numerics with the general-step kernels and the
fixed-shape decode; release numerics on the fixed-shape decode with packed weights; HiSparse on the
fixed-shape decode; the grouped prefill MoE and the top-k alone), then compiles each distinct one
(kernel, argument types, constexprs, warps, stages) for sm_90 in a child process without
TRITON_INTERPRET, and writes what failed.

Limits: the launches carry the interpreter's choices where a wrapper branches on it (float32 dots,
float32 engines), so bf16-only variants are compiled only where a CPU run makes them.

    python -m benchmarks run compile
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..lib.context import Context

TARGET = ("cuda", 90, 32)  # H200: compute capability 9.0, warps of 32
_DTYPES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1",
           "float8_e4m3fn": "fp8e4nv", "float8_e8m0fnu": "u8"}


def kernel_modules() -> list[str]:
    import antumbra.kernels

    return [info.name for info in pkgutil.walk_packages(antumbra.kernels.__path__, "antumbra.kernels.")]


def _arg_type(value: Any) -> str | None:
    """Triton signature type of a runtime argument (None: not a pointer or scalar it types)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


class Recorder:
    """Every launch of the project's kernels while active: (module, kernel, signature, constexprs,
    options), deduplicated."""

    def __init__(self) -> None:
        self.launches: dict[str, dict[str, Any]] = {}
        self._hooks: list[tuple[Any, Any]] = []

    def __enter__(self) -> Recorder:
        from triton.runtime.jit import KernelInterface

        for module_name in kernel_modules():
            module = importlib.import_module(module_name)
            for name, kernel in vars(module).items():
                if isinstance(kernel, KernelInterface) and getattr(kernel, "fn", None) is not None \
                        and kernel.fn.__module__ == module_name and hasattr(kernel, "add_pre_run_hook"):
                    hook = self._hook(module_name, name, kernel)
                    kernel.add_pre_run_hook(hook)
                    self._hooks.append((kernel, hook))
        return self

    def _hook(self, module_name: str, name: str, kernel: Any) -> Any:
        import inspect

        params = list(kernel.arg_names)
        constexpr = {p for p, spec in zip(params, _constexpr_flags(kernel), strict=True) if spec}
        defaults = {p.name: p.default for p in inspect.signature(kernel.fn).parameters.values()
                    if p.default is not inspect.Parameter.empty}

        def hook(*args: Any, **kwargs: Any) -> None:
            values = defaults | dict(zip(params, args, strict=False)) | {
                k: v for k, v in kwargs.items() if k in params}
            signature, consts = {}, {}
            for param in params:
                value = values.get(param)
                kind = None if param in constexpr else _arg_type(value)
                if kind is None:
                    signature[param], consts[param] = "constexpr", value
                else:
                    signature[param] = kind
            options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            entry = {"module": module_name, "kernel": name, "signature": signature,
                     "constexprs": {k: _plain(v) for k, v in consts.items()}, "options": options}
            self.launches.setdefault(json.dumps(entry, sort_keys=True, default=str), entry)

        return hook

    def __exit__(self, *exc: object) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)


def _constexpr_flags(kernel: Any) -> list[bool]:
    """Which parameters are `tl.constexpr` (from the annotations of the Python function)."""
    import inspect

    flags = []
    for p in inspect.signature(kernel.fn).parameters.values():
        flags.append("constexpr" in str(p.annotation))
    return flags


def _plain(value: Any) -> Any:
    """A constexpr value as JSON (triton dtypes by name)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return {"dtype": str(value)}


def workloads() -> dict[str, float]:
    """Run the tiny engines and kernels whose launches are recorded; -> seconds per workload."""
    import torch

    from antumbra import Engine, SamplingParams
    from antumbra.config import CacheConfig, FastPathConfig, SchedulerConfig
    from antumbra.kernels.indexer_topk import onepass
    from antumbra.kernels.indexer_topk.triton import topk_rows
    from antumbra.kernels.moe_mxfp4.grouped import moe_mxfp4_grouped
    from antumbra.replicas.model.release_format import save_release_checkpoint
    from antumbra.replicas.model.tiny import TinyModelSpec, build_model, make_tiny_checkpoint, mtp_tensors

    tmp = Path(tempfile.mkdtemp())
    plain = make_tiny_checkpoint(tmp / "plain", TinyModelSpec())
    spec = TinyModelSpec(seed=5)
    model = build_model(spec)
    release = save_release_checkpoint(model.state_dict(), model.config, tmp / "release",
                                      mtp_state_dict=mtp_tensors(spec))
    prompts = [list(range(3, 3 + n)) for n in (2, 126, 251)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sched = SchedulerConfig(max_model_len=512, max_num_seqs=4)
    runs = {
        "exact": (plain, {},
                  FastPathConfig(decode="on", general_kernels="on", cuda_graph_batch_sizes=(1, 4))),
        "release": (release, {"numerics": "release"},
                    FastPathConfig(decode="on", expert_format="mxfp4", linear_format="fp8",
                                   cuda_graph_batch_sizes=(1, 4))),
        "hisparse": (plain, {"cache": CacheConfig(hisparse_rows_per_request=64)},
                     FastPathConfig(decode="on", general_kernels="on", cuda_graph_batch_sizes=(1, 4))),
    }
    seconds = {}
    for label, (path, extra, fast) in runs.items():
        start = time.perf_counter()
        Engine.from_pretrained(path, device="cpu", dtype="float32", scheduler=sched, fast=fast,
                               **extra).generate(prompts, params)
        seconds[label] = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    x = torch.randn(20, 64, generator=gen)
    codes = torch.randint(0, 256, (4, 32, 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.full((4, 32, 2), 127, dtype=torch.uint8)
    down = torch.randint(0, 256, (4, 64, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    moe_mxfp4_grouped(x, torch.rand(20, 2, generator=gen), torch.randint(0, 4, (20, 2), generator=gen),
                      codes, scales, codes, scales, down, torch.full((4, 64, 1), 127, dtype=torch.uint8), 7.0)
    scores = torch.randn(2, 300, generator=gen)
    cand = torch.arange(600, dtype=torch.int32).view(2, 300)
    topk_rows(scores, cand, 16)
    plan = onepass.plan_programs(2, 300, torch.device("cpu"))  # the one-launch form, barriers included
    assert plan is not None
    onepass.topk_rows(scores, cand, 16, workspace=onepass.SelectWorkspace.allocate(2, 300, plan, "cpu"))
    sampler_launches(gen)
    cuda_only_launches(gen)
    seconds["kernels"] = time.perf_counter() - start
    return seconds


def cuda_only_launches(gen: Any) -> None:
    """Launches the engine makes on CUDA only: the one-token linears in bf16 as the model runs them
    (the GEMV of the small projections: two weights into state rows, one weight to a float32
    output; the FP8 linears' GEMV over two weights, `fp8_linear_pair`), and the decode graphs' count
    of drawn tokens into penalty slots and take of an overlapped launch's draws into the ids."""
    import torch

    from antumbra.kernels.decode_index.sources import take_sources
    from antumbra.kernels.fp8_linear import fp8_linear_pair
    from antumbra.kernels.gemv import gemv, gemv_into
    from antumbra.kernels.sampling.counts import count_drawn
    from antumbra.replicas.model.quant import quant_fp8_block

    counts, seen = torch.zeros(3, 16, dtype=torch.int32), torch.zeros(3, 16, dtype=torch.uint8)
    count_drawn(torch.tensor([4, 5]), torch.tensor([0, -1], dtype=torch.int32), counts, seen, 2)
    take_sources(torch.zeros(5, 8, dtype=torch.long)[:, :3], torch.zeros(4, dtype=torch.long))

    k = 2304  # few output tiles over a long K: the interpreter's plans split K (the finish compiles)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    w1, w2 = (torch.randn(16, k, generator=gen).to(torch.bfloat16) for _ in range(2))
    states = [torch.zeros(4, 16) for _ in range(2)]
    gemv_into(x, (w1, w2), states, rows=torch.tensor([2]))
    gemv(x, w1, scale=0.5, out_dtype=torch.float32)
    gemv(x, torch.randn(256, k, generator=gen).to(torch.bfloat16))  # one slice
    fp8_linear_pair(x, quant_fp8_block(torch.randn(32, k, generator=gen)),
                    quant_fp8_block(torch.randn(32, k, generator=gen)))


def sampler_launches(gen: Any) -> None:
    """The sampler's fused race over adjusted logits (penalties, bias, bans, min_p; two vocabulary
    chunks so the combine's second race runs) and its plain race, as the engine launches them."""
    import torch

    from antumbra import SamplingParams
    from antumbra.replicas.penalty_state import PenalisedRow, PenaltyState
    from antumbra.replicas.sampler import Sampler, SamplingRows

    vocab = 4096 + 64
    logits = torch.randn(3, vocab, generator=gen)
    params = [SamplingParams(frequency_penalty=0.5, logit_bias={4100: 2.0}, min_p=0.1),
              SamplingParams(min_tokens=4, temperature=0.0), SamplingParams(top_p=0.9)]
    state = PenaltyState(vocab, logits.device, (2,), max_slots=2)
    resident = state.rows_for([PenalisedRow("a", params[0], [1, 4099], [4099, 3]),
                               PenalisedRow("b", params[1], [], []), None])
    rows = SamplingRows.build(params, [1, 2, 3], [0, 0, 0], resident)
    Sampler(use_kernel=True).sample_tokens(logits, rows)


def compile_all(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In this process (no TRITON_INTERPRET): compile each launch for TARGET; -> one row each."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for entry in launches:
        kernel = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        consts = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v
                  for k, v in entry["constexprs"].items()}
        start = time.perf_counter()
        row = {"kernel": f"{entry['module']}.{entry['kernel']}", "constexprs": entry["constexprs"]}
        try:
            src = ASTSource(fn=kernel, signature=entry["signature"], constexprs=consts)
            triton.compile(src, target=GPUTarget(*TARGET), options=entry["options"])
            row["ok"] = True
        except Exception as exc:  # every failure is reported, none stops the others
            row["ok"], row["error"] = False, f"{type(exc).__name__}: {str(exc)[-1200:]}"
        row["s"] = time.perf_counter() - start
        rows.append(row)
    return rows


DEVICE = "cpu"  # the launches are recorded in the interpreter, whatever the machine


def run(ctx: Context) -> dict[str, Any]:
    with Recorder() as recorder:
        seconds = workloads()
    launches = list(recorder.launches.values())
    with tempfile.NamedTemporaryFile("w", suffix="-launches.json", delete=False) as f:
        json.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-m", "benchmarks.kernels.compile_sm90", f.name],
                           env=env, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(child.stderr[-3000:])
    rows = json.loads(child.stdout.strip().splitlines()[-1])
    failed = [r for r in rows if not r["ok"]]
    return {"target": f"sm_{TARGET[1]}", "workload_s": seconds, "launches": len(rows),
            "kernels": len({r["kernel"] for r in rows}), "failed": failed, "all_compile": not failed,
            "rows": rows}


if __name__ == "__main__":  # the child process: compile the launches recorded in the file named
    print(json.dumps(compile_all(json.loads(Path(sys.argv[1]).read_text()))))
