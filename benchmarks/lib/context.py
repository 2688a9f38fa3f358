"""What a suite hands each of its benchmarks: the device, smoke or not, options, the measured rates."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .floors import Rates, measure


@dataclass(frozen=True)
class Context:
    """`smoke`: the smallest shapes and counts, on a CPU with the kernels interpreted: it checks that a
    benchmark runs, its figures mean nothing. `options`: `--set name=value` from the command line."""

    device: str
    smoke: bool = False
    options: Mapping[str, str] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def rates(self) -> Rates:
        return measure(self.device)

    def option(self, name: str, default: Any) -> Any:
        """`--set name=value` converted to `default`'s type (a list of ints for a list default)."""
        if name not in self.options:
            return default
        text = self.options[name]
        if isinstance(default, list):
            return [int(x) for x in text.split(",") if x]
        if isinstance(default, bool):
            return text.lower() in ("1", "true", "yes", "on")
        return type(default)(text) if default is not None else text
