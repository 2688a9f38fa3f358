"""Every function a Triton kernel calls is itself `@triton.jit`.

The CPU interpreter runs kernels as Python, so a helper that lost its decorator still works in every
interpreter test, while compilation for a GPU refuses the kernel ("Unsupported function referenced")
and every path through it fails there. This walks the kernels' globals instead."""

from __future__ import annotations

import importlib
import pkgutil
import types

from triton.runtime.jit import KernelInterface

import antumbra.kernels

# `@triton.jit` objects: JITFunction when compiling, InterpretedFunction under TRITON_INTERPRET=1.
JITTED = KernelInterface


def _kernel_modules() -> list[types.ModuleType]:
    found = []
    for info in pkgutil.walk_packages(antumbra.kernels.__path__, "antumbra.kernels."):
        found.append(importlib.import_module(info.name))
    return found


def test_kernels_call_only_jit_functions() -> None:
    checked, problems = 0, []
    for module in _kernel_modules():
        for name, value in vars(module).items():
            if not isinstance(value, JITTED) or value.fn.__module__ != module.__name__:
                continue
            checked += 1
            for ref in value.fn.__code__.co_names:
                target = value.fn.__globals__.get(ref)
                if isinstance(target, types.FunctionType):  # a jitted one is a KernelInterface
                    problems.append(f"{module.__name__}.{name} calls the plain function {ref}")
    assert checked > 40, f"only {checked} kernels found: the walk is broken"
    assert not problems, problems
