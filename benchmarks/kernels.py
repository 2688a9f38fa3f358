"""All kernel benchmarks in one run on one GPU, plus the GPU-vs-CPU engine agreement check.

Each op module checks correctness at real shapes (poisoned outputs, fresh random
inputs) and times itself against its floor and the PyTorch chain it replaces; a
module that fails is recorded with its error and the rest still run. Results go
to `benchmarks/results/<date>-h200.json` (or `<date>-<device>.json`) with a
`ratios` table of the headline figures.

    python -m benchmarks.kernels [--smoke] [--only attention,topk,...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
import traceback
from typing import Any

import torch

from .common import RESULTS_DIR, environment, write_result
from .targets import summarize

MODULES = {
    "attention": "benchmarks.kernel_attention",
    "topk": "benchmarks.kernel_topk",
    "compressor": "benchmarks.kernel_compressor",
    "mhc": "benchmarks.kernel_mhc",
    "moe": "benchmarks.kernel_moe",
    "fp8_linear": "benchmarks.kernel_fp8_linear",
    "norm_rope": "benchmarks.kernel_norm_rope",
    "decode_index": "benchmarks.kernel_decode_index",
    "dequant": "benchmarks.kernel_dequant_gpu",
    "indexer_prefill": "benchmarks.kernel_indexer_prefill",
}
HEADLINE_KEYS = (
    "decode_attention_roofline_B32",
    "decode_attention_vs_torch_B32",
    "topk_vs_torch_B1_N65536",
    "compressor_vs_torch",
    "mhc_vs_torch",
    "moe_mxfp4_weight_bw_B1",
    "moe_mxfp4_weight_bw_B8",
    "fp8_linear_floor_frac_B1",
    "fp8_linear_vs_bf16_decode",
    "norm_rope_vs_torch_B1",
    "decode_index_vs_torch_B1",
)


def run_modules(names: list[str], device: str, smoke: bool, sink: dict[str, Any], save) -> None:
    for name in names:
        start = time.perf_counter()
        try:
            module = importlib.import_module(MODULES[name])
            sink["kernels"][name] = module.run(device, smoke=smoke)
        except Exception as exc:  # one broken kernel must not hide the others' figures
            sink["kernels"][name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        sink["kernels"][name]["wall_s"] = time.perf_counter() - start
        for key in HEADLINE_KEYS:
            if key in sink["kernels"][name]:
                sink["ratios"][key] = sink["kernels"][name][key]
        for key, value in sink["kernels"][name].items():
            if key.startswith("topk_alone_vs_torch_"):
                sink["ratios"][key] = value
        save()


def engine_agreement(device: str, num_tokens: int = 32) -> dict[str, Any]:
    """Greedy generation on `device` against the CPU fp32 engine, token for token."""
    import tempfile
    from pathlib import Path

    from antumbra import Engine, SamplingParams
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 261, (n,), generator=g).tolist() for n in (1, 5, 129, 300, 700)]
        cpu = Engine.from_pretrained(path, device="cpu", dtype="float32").generate(prompts, params)
        gpu = Engine.from_pretrained(path, device=device, dtype="float32").generate(prompts, params)
    rows = [
        {
            "prompt_len": len(p),
            "identical": a.token_ids == b.token_ids,
            "cpu": a.token_ids,
            "gpu": b.token_ids,
        }
        for p, a, b in zip(prompts, cpu, gpu, strict=True)
    ]
    return {"all_identical": all(r["identical"] for r in rows), "num_tokens": num_tokens, "prompts": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU in the interpreter")
    parser.add_argument("--only", default=",".join(MODULES))
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # Kernels run in the interpreter on CPU; this must be set before they are defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    name = "h200" if "H200" in environment()["device"] else device
    result: dict[str, Any] = {**environment(), "smoke": args.smoke, "kernels": {}, "ratios": {}}
    earlier = RESULTS_DIR / f"{result['date']}-{name}{'-smoke' if args.smoke else ''}.json"
    if earlier.exists():
        # A partial run (--only) updates today's file instead of dropping the other kernels' figures,
        # but only when that file holds figures of this very commit: runs of two commits never mix.
        kept = json.loads(earlier.read_text())
        if kept.get("commit") == result["commit"]:
            result = {
                **kept,
                **environment(),
                "kernels": kept.get("kernels", {}),
                "ratios": kept.get("ratios", {}),
            }

    def save() -> None:
        result["targets"] = summarize(result)
        write_result(name + ("-smoke" if args.smoke else ""), result)

    if not args.no_engine:
        try:
            result["engine_gpu_vs_cpu"] = engine_agreement(device)
        except Exception as exc:
            result["engine_gpu_vs_cpu"] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        save()
    run_modules([n for n in args.only.split(",") if n], device, args.smoke, result, save)
    print(
        json.dumps(
            {"ratios": result["ratios"], "engine": result.get("engine_gpu_vs_cpu", {}).get("all_identical")}
        )
    )


if __name__ == "__main__":
    main()
