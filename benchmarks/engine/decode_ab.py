"""The decode step of this tree against another build of the engine, in one run on one device.

Options: `--set baseline=DIR` (a tree holding an `antumbra/` package, e.g. an earlier commit unpacked
with `git archive COMMIT antumbra | tar -x -C DIR`; without it only this tree is timed),
`--set checkpoint=DIR` (a release-layout slice checkpoint; written by `engine.slice_checkpoint` when
absent), `--set batches=1,32`, `--set ctx=4096`. Both builds load the same checkpoint through
`Engine.from_pretrained` and are timed by the same worker (`decode_ab_worker.py`, public API only),
each in its own process. Ratios: `decode_step_vs_baseline_B{b}` (this tree's step over the baseline's:
below 1 is faster).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib.context import Context
from benchmarks.lib.tree_hash import ROOT

DEVICE = "cuda"
WORKER = Path(__file__).with_name("decode_ab_worker.py")


def _side(tree: Path, checkpoint: Path, batches: list[int], ctx: int) -> dict[str, Any]:
    # The tree under test first; the rest of the path (packages carried beside the image's) after it.
    path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, str(WORKER), "--ckpt", str(checkpoint), "--ctx", str(ctx),
           "--batches", ",".join(map(str, batches))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-4000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(ctx: Context) -> dict[str, Any]:
    if ctx.smoke:
        return {"skipped": "times two engine builds on a GPU slice; nothing to check on a CPU"}
    batches = ctx.option("batches", [1, 32])
    context_len = ctx.option("ctx", 4096)
    checkpoint = Path(ctx.option("checkpoint", "") or tempfile.mkdtemp(prefix="slice-"))
    if not any(checkpoint.glob("*.safetensors")):
        from benchmarks.engine.slice_checkpoint import write_slice_checkpoint
        from benchmarks.lib.slices import SliceSpec

        write_slice_checkpoint(checkpoint, SliceSpec(), ctx.device)
    out: dict[str, Any] = {"this": _side(ROOT, checkpoint, batches, context_len)}
    baseline = ctx.option("baseline", "")
    if baseline:
        out["baseline"] = _side(Path(baseline).resolve(), checkpoint, batches, context_len)
        ratios = {}
        for b in batches:
            try:
                ratios[f"decode_step_vs_baseline_B{b}"] = (
                    out["this"]["steps"][str(b)]["step_ms"] / out["baseline"]["steps"][str(b)]["step_ms"])
            except KeyError:
                continue
        out["ratios"] = ratios
    return out
