"""Fault injection for tests, which the product does not import: it patches the engine's seams.

Three faults, each keyed by a token id that no ordinary prompt of the tests holds:

* `raise=T`: a step holding a prompt with token T raises before it runs (only that step's requests
  fail; the engine re-runs the rest chunk by chunk);
* `fatal=T`: the same step raises a failure the engine cannot continue from (as a lost device would),
  so the engine stops and the replica reports unhealthy;
* `die=T@MARKER`: a prefill replica that has computed a prompt holding T kills its own process before
  the handoff, once per MARKER file (the marker is created first, so its replacement lives).

In this process: `with injected("raise=6"): ...`. In Ray Serve's replica processes: the product loads
the plugins `ANTUMBRA_PLUGINS` names when it builds an engine (`antumbra/replicas/plugins.py`), so a
test starts Ray with `ANTUMBRA_PLUGINS=tests.faults.injection:raise=6` in its environment
(`in_new_processes`): Ray's raylet keeps that environment and hands it to every replica it starts,
replacements included, while this process's own engines stay without the fault.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from antumbra import env
from antumbra.replicas.errors import FatalEngineError
from antumbra.replicas.kv_transfer.disaggregation import Disaggregation
from antumbra.replicas.overlap import OverlapStepper
from antumbra.replicas.runner import ModelRunner
from antumbra.replicas.step_io import SchedulerOutput

log = logging.getLogger(__name__)

_step_faults: dict[int, bool] = {}  # token -> fatal
_deaths: dict[int, str | None] = {}  # token -> marker file
_originals: dict[tuple[type, str], Any] = {}


def parse(spec: str) -> tuple[str, int, str | None]:
    """`raise=T`, `fatal=T` or `die=T@MARKER` -> (kind, token, marker)."""
    kind, _, rest = spec.partition("=")
    token, _, marker = rest.partition("@")
    if kind not in ("raise", "fatal", "die") or not token.isdigit():
        raise ValueError(f"not a fault: {spec!r} (raise=T, fatal=T or die=T@MARKER)")
    return kind, int(token), marker or None


def install(argument: str) -> None:
    """The plugin entry point: install the fault `argument` names, for the rest of the process."""
    kind, token, marker = parse(argument)
    if kind == "die":
        _deaths[token] = marker
    else:
        _step_faults[token] = kind == "fatal"
    _patch()


@contextmanager
def injected(*specs: str) -> Iterator[None]:
    """The faults `specs` name, in this process, until the block ends."""
    saved = dict(_step_faults), dict(_deaths)
    for spec in specs:
        install(spec)
    try:
        yield
    finally:
        _step_faults.clear(), _step_faults.update(saved[0])
        _deaths.clear(), _deaths.update(saved[1])
        if not _step_faults and not _deaths:
            _unpatch()


@contextmanager
def in_new_processes(*specs: str) -> Iterator[Callable[[], None]]:
    """Within: processes started (Ray's, by `local_platform`) install `specs` in their engines; this
    module must be importable there, so the tree's root goes on their PYTHONPATH. The block calls the
    function it is given once those processes started, which puts this process's environment back
    (so do the block's end)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    wanted = {env.PLUGINS: ",".join(f"{__name__}:{spec}" for spec in specs), "PYTHONPATH": path}
    saved = {name: os.environ.get(name) for name in wanted}

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    os.environ.update(wanted)
    try:
        yield restore
    finally:
        restore()


def _holds_fault(chunks: list[Any]) -> int | None:
    for chunk in chunks:
        for token in _step_faults:
            if token in chunk.request.prompt_token_ids:
                return token
    return None


def _patch() -> None:
    if _originals:
        return
    execute, eligible = ModelRunner.execute, OverlapStepper.eligible
    export = Disaggregation.prefill_export_async

    @functools.wraps(execute)
    def faulty_execute(runner: ModelRunner, step: SchedulerOutput) -> Any:
        token = _holds_fault(list(step.chunks))
        if token is not None:
            error = FatalEngineError if _step_faults[token] else RuntimeError
            raise error(f"injected fault: a prompt in the step holds token {token}")
        return execute(runner, step)

    @functools.wraps(eligible)
    def eligible_unless_faulty(stepper: OverlapStepper, chunks: list[Any], rows: Any) -> bool:
        # An overlapped step is applied a step later: a faulty one runs the plain way, so it raises
        # where the engine's failure handling expects it.
        return _holds_fault(chunks) is None and eligible(stepper, chunks, rows)

    @functools.wraps(export)
    async def export_then_die(pd: Disaggregation, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        payload = await export(pd, prompt, *args, **kwargs)
        for token, marker in _deaths.items():
            held = not isinstance(prompt, str) and token in list(prompt)
            if held and (marker is None or not os.path.exists(marker)):
                if marker is not None:
                    open(marker, "w").close()
                log.error("injected fault: this prefill replica dies before the handoff")
                os._exit(1)
        return payload

    for owner, name, patched in ((ModelRunner, "execute", faulty_execute),
                                 (OverlapStepper, "eligible", eligible_unless_faulty),
                                 (Disaggregation, "prefill_export_async", export_then_die)):
        _originals[(owner, name)] = owner.__dict__.get(name)
        setattr(owner, name, patched)


def _unpatch() -> None:
    for (owner, name), original in _originals.items():
        if original is None:
            delattr(owner, name)  # it was inherited: the base class's comes back
        else:
            setattr(owner, name, original)
    _originals.clear()
