"""A launched decode step's tokens on their way to the host (`decode_graphs.py`, `overlap.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .structured.masks import PendingMask


class Launched:
    """The tokens of one launched step, on their way to the host. A masked launch (structured
    output) has run its forward only: it draws once its masks are known, either given at once
    (`draw`) or computing on the mask worker (`defer`), in which case the draw is enqueued at the
    last moment: by `finish`, before the next launch's forward (which reads these tokens on the
    device), or when the tokens are read."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None,
                 draw: Callable[[torch.Tensor | None], torch.cuda.Event | None] | None = None,
                 device: torch.device | None = None) -> None:
        self._host, self._event, self._draw = host, event, draw
        self._device = device
        self._pending: PendingMask | None = None
        self._deferred = False

    def draw(self, allowed: torch.Tensor | None) -> None:
        """Sample the launched forward under allowed [count, W] int32 bitmasks (on the device)."""
        assert self._draw is not None, "this launch has drawn its tokens already"
        self._event, self._draw, self._pending, self._deferred = self._draw(allowed), None, None, False

    def defer(self, pending: PendingMask | None) -> None:
        """Draw under `pending`'s masks (None: no row is constrained any more) when `finish` runs."""
        assert self._draw is not None, "this launch has drawn its tokens already"
        self._pending, self._deferred = pending, True

    def finish(self) -> None:
        """Enqueue a deferred draw now (waiting for its masks); nothing for a drawn launch."""
        if self._deferred:
            device = self._device if self._device is not None else torch.device("cpu")
            self.draw(self._pending.result(device) if self._pending is not None else None)

    def tokens(self) -> list[int]:
        self.finish()
        if self._draw is not None:
            raise RuntimeError("a masked launch's tokens are read before it was drawn")
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
