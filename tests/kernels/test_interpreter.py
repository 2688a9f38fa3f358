"""The interpreter patches of `kernels/common/interpreter.py` (the suite runs interpreted:
tests/conftest.py) keep the interpreter's answers: the NumPy storage dtype of every Triton dtype, and
a tuple's type however late it is read."""

from __future__ import annotations

import numpy as np
import pytest
import triton.language as tl
from triton.language import core
from triton.runtime import interpreter

from antumbra.kernels.common.interpreter import prepare

DTYPES = (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
          tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e4nv)


def test_storage_dtypes_are_the_interpreters() -> None:
    prepare()
    assert interpreter._antumbra_np_dtype_cache
    expected = {tl.int1: bool, tl.float16: np.float16, tl.float32: np.float32, tl.float64: np.float64,
                tl.int8: np.int8, tl.uint8: np.uint8, tl.int16: np.int16, tl.uint16: np.uint16,
                tl.int32: np.int32, tl.uint32: np.uint32, tl.int64: np.int64, tl.uint64: np.uint64,
                tl.bfloat16: np.uint16, tl.float8e5: np.uint8, tl.float8e4nv: np.uint8}
    for _ in range(2):  # the second round is answered from the cache
        for dtype in DTYPES:
            assert interpreter._get_np_dtype(dtype) == np.dtype(expected[dtype])
            assert interpreter._get_np_dtype(tl.block_type(dtype, [4, 8])) == np.dtype(expected[dtype])
    pointer = tl.pointer_type(tl.float32)
    assert interpreter._get_np_dtype(pointer) == np.dtype(np.uint64)
    assert interpreter._get_np_dtype(tl.block_type(pointer, [16])) == np.dtype(np.uint64)
    with pytest.raises(KeyError):
        interpreter._get_np_dtype(tl.void)


def test_a_tuples_type_is_built_from_its_values_when_read() -> None:
    prepare()
    shape = tl.tuple([4, 8])
    assert "_antumbra_type" not in shape.__dict__  # not built yet
    assert shape.type == core._type_for_tuple_values([4, 8])
    assert str(shape.type) == str(core.tuple_type([core.constexpr_type(4), core.constexpr_type(8)]))
    shape._setitem(1, 16)  # a change rebuilds it, as before
    assert shape.type == core._type_for_tuple_values([4, 16])
    given = core.tuple_type([core.constexpr_type(1)], ["x"])
    named = tl.tuple([1], given)
    assert named.type is given and named.x == 1


def test_every_kernel_module_prepares_the_interpreter_before_its_kernels() -> None:
    """A kernel module imported alone (a benchmark's `--smoke` run) must patch the interpreter
    itself: one that relied on another module's import failed its first launch there."""
    import ast
    import importlib.util

    from antumbra.kernels.variants import KERNEL_MODULES

    for name in KERNEL_MODULES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        tree = ast.parse(open(spec.origin).read())
        calls = [i for i, node in enumerate(tree.body) if isinstance(node, ast.Expr)
                 and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "prepare"]
        kernels = [i for i, node in enumerate(tree.body) if isinstance(node, ast.FunctionDef)
                   and any("jit" in ast.unparse(d) for d in node.decorator_list)]
        assert calls, f"{name} never calls prepare() at module level"
        assert not kernels or calls[0] < kernels[0], f"{name} defines a kernel before prepare()"
