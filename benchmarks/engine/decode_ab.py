"""The decode step of this tree against another build of the engine, in one run on one device.

Options: `--set baseline=DIR` (a tree holding an `antumbra/` package, e.g. an earlier commit unpacked
with `git archive COMMIT antumbra | tar -x -C DIR`; without it only this tree is timed),
`--set checkpoint=DIR` (a release-layout slice checkpoint; written by `engine.slice_checkpoint` when
absent), `--set batches=1,32`, `--set ctx=4096`, `--set rounds=5`. Both builds load the same checkpoint
through `Engine.from_pretrained` and are timed by the same worker (`decode_ab_worker.py`, public API
only), each in its own process, both resident at once: the measurements alternate between them, round
by round (the order flipping each round), so drift of the device or the host over the run falls on
both alike. Each side's step is the median of its rounds. Ratios: `decode_step_vs_baseline_B{b}`
(this tree's step over the baseline's: below 1 is faster).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib.context import Context
from benchmarks.lib.tree_hash import ROOT

DEVICE = "cuda"
WORKER = Path(__file__).with_name("decode_ab_worker.py")


class _Side:
    """One build's worker process (`decode_ab_worker.py --serve`), its engine loaded."""

    def __init__(self, tree: Path, checkpoint: Path, batches: list[int], ctx: int) -> None:
        # The tree under test first; the rest of the path (packages carried beside the image's) after it.
        path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        cmd = [sys.executable, str(WORKER), "--ckpt", str(checkpoint), "--ctx", str(ctx),
               "--batches", ",".join(map(str, batches)), "--reps", "1", "--serve"]
        self.errors = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errors, text=True)
        self.result: dict[str, Any] = {}

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.errors.seek(0)
            raise RuntimeError(self.errors.read()[-4000:])
        return json.loads(line)

    def ready(self) -> None:
        self.result = {**self._line(), "steps": {}}

    def measure(self, batch: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch}\n")
        self.proc.stdin.flush()
        step = self._line()["step_ms"]
        self.result["steps"].setdefault(str(batch), {"step_ms_all": []})["step_ms_all"].append(step)
        return float(step)

    def close(self) -> dict[str, Any]:
        if self.proc.stdin is not None and self.proc.poll() is None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for entry in self.result.get("steps", {}).values():
            entry["step_ms"] = statistics.median(entry["step_ms_all"])
        return self.result


def _alternate(sides: list[_Side], batches: list[int], rounds: int) -> None:
    """Every round measures each batch on every side, the sides' order flipping each round."""
    for r in range(rounds):
        for batch in batches:
            for i, side in (enumerate(sides) if r % 2 == 0 else reversed(list(enumerate(sides)))):
                step_ms = side.measure(batch)
                # One line per measurement, so a run cut short still tells its figures.
                line = {"round": r, "side": i, "batch": batch, "step_ms": step_ms}
                print(json.dumps(line), file=sys.stderr, flush=True)


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
    baseline = ctx.option("baseline", "")
    names = ["this", "baseline"] if baseline else ["this"]
    trees = [ROOT, Path(baseline).resolve()] if baseline else [ROOT]
    sides = [_Side(tree, checkpoint, batches, context_len) for tree in trees]
    out: dict[str, Any] = {"rounds": int(ctx.option("rounds", 5))}
    try:
        for side in sides:
            side.ready()
        _alternate(sides, batches, out["rounds"])
    except RuntimeError as exc:
        return {**out, "error": str(exc)}
    finally:
        results = [side.close() for side in sides]
    out.update(zip(names, results, strict=True))
    if baseline:
        ratios = {}
        for b in batches:
            try:
                ratios[f"decode_step_vs_baseline_B{b}"] = (
                    out["this"]["steps"][str(b)]["step_ms"] / out["baseline"]["steps"][str(b)]["step_ms"])
            except KeyError:
                continue
        out["ratios"] = ratios
    return out
