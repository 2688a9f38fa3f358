"""The draw of a structured-output decode step, after its forward and under its rows' masks.

A masked launch (`decode_graphs.DecodeGraphs.launch(masked=True)`) runs the forward only; its
rows are drawn once the mask worker has filled their allowed-token bitmasks (`structured/masks.py`).
On the graph path the draw is itself a small captured graph per batch size: the masks are staged
into a static [B, W] int32 buffer, then one replay applies them to the forward graph's logits in
place (the forward rewrites those every replay) and runs the step's race (`GraphRace.race(late=
True)`: penalised rows are counted by this draw, not the forward's). Without graphs the same two
operations run eagerly on a masked copy.
"""

from __future__ import annotations

from typing import Any

import torch

from antumbra.kernels.token_mask import apply_token_mask, apply_token_mask_reference

from .graph_race import GraphRace


class MaskedDraw:
    """Masked draws into `race.tokens` for up to `max_rows` rows on `device`; draw graphs are
    captured into `graph_pool` (the decode graphs' own)."""

    def __init__(self, race: GraphRace, max_rows: int, device: torch.device, graph_pool: Any) -> None:
        self.race = race
        self.max_rows = max_rows
        self.device = device
        self.graph_pool = graph_pool
        self._allowed: torch.Tensor | None = None  # [max_rows, W] int32, the staged masks
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, int]] = {}  # size -> (graph, logits address)

    def draw(self, logits: torch.Tensor, count: int, allowed: torch.Tensor | None, graphed: bool) -> None:
        """Draw rows [:count] of logits [size, V] (the launch's; a forward graph's own buffer when
        `graphed`) under allowed [count, W] int32 bitmasks on the device (None: no row is
        constrained any more, their requests having just finished)."""
        if allowed is not None and graphed:
            self._stage(allowed, count)
            self._graph_for(logits).replay()
            return
        rows = logits[:count]
        if allowed is not None:
            rows = (apply_token_mask if rows.is_cuda else apply_token_mask_reference)(rows, allowed)
        self.race.race(rows, count, late=True)

    def clear(self) -> None:
        """Forget the captured draws (the forward graphs they read were dropped)."""
        self._graphs.clear()

    def _stage(self, allowed: torch.Tensor, count: int) -> None:
        """Rows past `count` (padding) keep what they held, all ones at first: their draws are never read."""
        if self._allowed is None or self._allowed.shape[1] != allowed.shape[1]:
            self._allowed = torch.full((self.max_rows, allowed.shape[1]), -1, dtype=torch.int32,
                                       device=self.device)
            self._graphs.clear()
        self._allowed[:count].copy_(allowed, non_blocking=True)

    def _graph_for(self, logits: torch.Tensor) -> torch.cuda.CUDAGraph:
        size = logits.shape[0]
        known = self._graphs.get(size)
        if known is not None and known[1] == logits.data_ptr() and not self.race.stale():
            return known[0]
        assert self._allowed is not None
        allowed = self._allowed[:size]

        def draw() -> None:
            apply_token_mask(logits, allowed, out=logits)
            self.race.race(logits, size, late=True)

        # The warm-up (kernel compilation) runs on the live step with its slots blanked, so it counts
        # nothing; masking twice is masking once, and the replay then draws the step for real.
        saved = self.race.blank()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            draw()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.race.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
            draw()
        self._graphs[size] = (graph, logits.data_ptr())
        return graph
