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


def _patch_numpy_dtype_lookup() -> None:
    """triton 3.6's interpreter maps a Triton dtype to its NumPy storage dtype by building a table of
    about twenty NumPy dtypes at every call, and it calls that for nearly every interpreted operation.
    The mapping depends on the (element) dtype alone, so each answer is kept. Values are the
    interpreter's own; a dtype it does not know still raises as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_antumbra_np_dtype_cache", False):
        return
    original = interpreter._get_np_dtype
    cache: dict[object, object] = {}

    def np_dtype(tt_dtype):  # type: ignore[no-untyped-def]
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):  # unhashable; addresses are stored as uint64
            return original(element)
        found = cache.get(element)
        if found is None:
            found = cache[element] = original(element)
        return found

    interpreter._get_np_dtype = np_dtype
    interpreter._antumbra_np_dtype_cache = True


def _patch_lazy_tuple_types() -> None:
    """triton 3.6 builds a `tl.tuple`'s type, a name string over its element types included, when the
    tuple is made; the interpreter makes one for every shape of every operation and reads few of those
    types. A tuple made without a type now builds it when it is first read, from the values it holds
    then (as `_setitem` rebuilds it after a change)."""
    import triton.language as tl
    from triton.language import core

    if getattr(core, "_antumbra_lazy_tuple_types", False):
        return

    def init(self, args, type=None):  # type: ignore[no-untyped-def]
        self.values = list(args)
        if type is not None:
            self.type = type if isinstance(type, core.tuple_type) else core.tuple_type(type)

    def get_type(self):  # type: ignore[no-untyped-def]
        found = self.__dict__.get("_antumbra_type")
        if found is None:
            found = self.__dict__["_antumbra_type"] = core._type_for_tuple_values(self.values)
        return found

    def set_type(self, value) -> None:  # type: ignore[no-untyped-def]
        self.__dict__["_antumbra_type"] = value

    tl.tuple.__init__ = init
    tl.tuple.type = property(get_type, set_type)
    core._antumbra_lazy_tuple_types = True


def prepare() -> None:
    if interpreting():
        _patch_scalar_index()
        _patch_language_once_per_launch()
        _patch_numpy_dtype_lookup()
        _patch_lazy_tuple_types()
