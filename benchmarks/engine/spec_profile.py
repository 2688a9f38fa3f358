"""Where a speculating step's time goes (`spec_decode --set profile=on`): the device's share against
the host's.

Over a batch of greedy requests already speculating (their drafter's cycle running), three figures:

- `wall_ms_per_step`: engine steps back to back, the device drained at both ends (and
  `wall_ms_per_step_unfused`: the same with each draft cycle launched only after the host read the
  verify step's verdict, `MTPSpeculation.fuse` off);
- `graph_ms`: each captured graph the steps used, replayed alone back to back (its inputs as the last
  step left them: it rewrites the same rows with the same values): the verify step's graph at the
  batch's k + 1 rows a request, the plain decode graph at the batch, and the drafter's cycle. Their sum
  is the device's time of a cycle when nothing waits for the host;
- `host`: cProfile's cumulative microseconds per step of the host's functions (over 20 us).

`device_share` = (verify graph + draft graph) / wall: how far the step is from device-bound.
"""

from __future__ import annotations

from typing import Any

from ..lib.timing import ms_per_call, timed_steps_ms


def speculation_profile(engine: Any, batch_prompts: list[list[int]], num_drafts: int, device: str,
                        steps: int = 6, replays: int = 50) -> dict[str, Any]:
    """The figures above for `batch_prompts` on `engine` (speculation on, greedy)."""
    from antumbra import SamplingParams

    from .slice_steps import host_profile

    core = engine.core
    fast, speculation = core.runner.fast, core.runner.speculation
    if speculation is None:
        return {"skipped": "speculation is off"}
    engine.clear_cache()
    room = core.config.scheduler.max_model_len - max(len(p) for p in batch_prompts) - 1
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    rids = [core.add_request(p, params) for p in batch_prompts]
    try:
        while not all(core.requests[r].output_token_ids for r in rids):
            core.step()
        for _ in range(2):  # the first drafts made: every request speculates from here
            core.step()
        wall_ms = timed_steps_ms(engine, steps, device)
        unfused_ms = None
        if hasattr(speculation, "fuse"):  # the same steps with each draft cycle launched after the verdict
            speculation.fuse = False
            try:
                unfused_ms = timed_steps_ms(engine, steps, device)
            finally:
                speculation.fuse = True
        host = host_profile(engine, steps)["rows"]
        graphs = (_graph_ms(fast, speculation.drafter, len(batch_prompts), num_drafts, replays, device)
                  if fast is not None and device.startswith("cuda") else {})
    finally:
        for rid in rids:
            core.abort(rid)
    cycle = graphs.get("verify", 0.0) + graphs.get("draft_after_verify", graphs.get("draft", 0.0))
    return {"steps": steps, "wall_ms_per_step": wall_ms, "wall_ms_per_step_unfused": unfused_ms,
            "graph_ms": graphs, "device_share": cycle / wall_ms if cycle else None, "host": host}


def _graph_ms(fast: Any, drafter: Any, batch: int, num_drafts: int, replays: int, device: str
              ) -> dict[str, float]:
    """Milliseconds per replay of each graph a speculating step of `batch` requests uses."""
    out: dict[str, float] = {}
    verify = fast.graph_for(batch * (num_drafts + 1))
    if verify is not None:
        out["verify"] = _replay_ms(verify[0], replays, device)
    plain = fast.graph_for(batch)
    if plain is not None:
        out["plain_decode"] = _replay_ms(plain[0], replays, device)
    graphs = getattr(drafter, "graphs", None)
    if graphs is not None and graphs.use_graphs:
        size = min((s for s in graphs.batch_sizes if s >= batch), default=None)
        # Keyed (size,) for a cycle after the verdict, (size, the verify step's buffers...) for one
        # launched behind its verify step.
        for key, captured in list(graphs._graphs.items()):
            if key[0] == size:
                name = "draft_after_verify" if len(key) > 1 else "draft"
                out[name] = _replay_ms(captured[0], replays, device)
    return out


def _replay_ms(graph: Any, replays: int, device: str) -> float:
    graph.replay()  # the first replay uploads the graph
    return ms_per_call(graph.replay, replays, device)
