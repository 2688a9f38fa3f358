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


def _patch_language_once_per_launch() -> None:
    """triton 3.6's interpreter re-patches `triton.language` (hundreds of attributes) at every call of
    a jitted helper inside a kernel, and never undoes those patches: the launch's own patch is still
    in place then, and its restore at the launch's end undoes everything. A nested call whose
    language modules the launch already patched skips the repeat (it cost about 40% of an
    interpreted engine step); other calls patch as before. Per thread, as launches are."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_antumbra_patch_once", False):
        return
    original = interpreter._patch_lang
    state = threading.local()

    def patch_lang(fn):  # type: ignore[no-untyped-def]
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        patched = getattr(state, "patched", None)
        if patched is not None and langs <= patched:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        scope = original(fn)
        if patched is not None:  # a nested call reaching other modules: patched as before, kept
            patched |= langs
            return scope
        state.patched = set(langs)  # the launch's patch, undone by its restore
        restore = scope.restore

        def restore_and_end() -> None:
            state.patched = None
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang
    interpreter._antumbra_patch_once = True


def prepare() -> None:
    if interpreting():
        _patch_scalar_index()
        _patch_language_once_per_launch()
