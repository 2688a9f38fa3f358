"""CPU-interpreter compatibility for the Triton kernels; no effect on a GPU.

Kernel modules call `prepare()` at import time, before defining kernels.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_scalar_index() -> None:
    """triton 3.6's interpreter holds scalars as shape-[1] arrays and turns them into loop
    bounds with `int(array)`, which NumPy >= 2.4 rejects; index through the single element."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_antumbra_scalar_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._antumbra_scalar_index = True


def prepare() -> None:
    if interpreting():
        _patch_scalar_index()
