"""The output side of the engine: token outputs become text outputs, off the stepping thread.

The engine core reports token ids only (`progress.snapshot`: empty text). `TextOutputs` runs
each request's incremental detokenizer over the outputs in the order they were produced and fills
`text` / `new_text`; it is also where stop strings are found, since they need the text.

A stop string found here ends the request at the token that completed it, exactly as if the
engine had seen it: the text is cut where the detokenizer cuts it and the token ids (and their
logprobs) after that token are dropped. The engine may have drawn a token or two past it by
then: `process` says at how many output tokens the request must end (`Processed.stop_at`), the
caller has the core cut and finish it (`EngineCore.stop_at`), and every output of the request
until that final one is dropped here; the final one is reported with finish_reason "stop".

Not thread-safe beyond this: `register` may run on any thread, `process` on one thread at a time.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .request import Request, RequestOutput
from .sampling_params import SamplingParams


class Processed(NamedTuple):
    output: RequestOutput | None  # None: dropped (the request stopped on a string already)
    stop_at: int | None  # the request's output tokens once a stop string ended it here, else None


@dataclass
class _Text:
    detokenizer: Any  # detokenizer.IncrementalDetokenizer
    params: SamplingParams
    stop_at: int | None = None  # output tokens kept, once a stop string was found
    text: str = ""  # the text reported so far (cut at the stop once stopped)


class TextOutputs:
    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self._lock = threading.Lock()
        self._texts: dict[str, _Text] = {}

    def register(self, request: Request) -> None:
        """Follow the request's outputs (a request without a detokenizer keeps empty text)."""
        if request.detokenizer is not None:
            with self._lock:
                self._texts[request.request_id] = _Text(request.detokenizer, request.params)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._texts.pop(request_id, None)

    def process(self, out: RequestOutput) -> Processed:
        """The output with its text; see the module's docstring for stops."""
        with self._lock:
            state = self._texts.get(out.request_id)
            if state is not None and out.finished:
                del self._texts[out.request_id]
        if state is None:
            return Processed(out, None)
        if state.stop_at is not None:  # stopped on a string: only the final output is reported
            return Processed(_cut(out, state, [], "") if out.finished else None, None)
        new_text, new_ids = "", out.new_token_ids
        first = len(out.token_ids) - len(new_ids)
        for i, token in enumerate(new_ids):
            if out.finished and i == len(new_ids) - 1 and self._ended_by_eos(out, token, state.params):
                break  # an end-of-sequence token adds no text
            step = state.detokenizer.append(token)
            new_text += step.new_text
            if step.stopped:
                state.stop_at = first + i + 1
                new_ids = new_ids[: i + 1]
                break
        if state.stop_at is None:
            if out.finished:
                new_text += state.detokenizer.finish()
            state.text = state.detokenizer.text
            return Processed(out.with_text(state.text, new_text), None)
        state.text = state.detokenizer.text
        stopped = _cut(out, state, new_ids, new_text)
        if out.finished:
            return Processed(stopped, None)
        return Processed(stopped, state.stop_at)

    def _ended_by_eos(self, out: RequestOutput, token: int, params: SamplingParams) -> bool:
        return out.finish_reason == "stop" and token in self.eos_token_ids and not params.ignore_eos


def _cut(out: RequestOutput, state: _Text, new_ids: list[int], new_text: str) -> RequestOutput:
    """`out` ended at the stop: its tokens after it dropped, its text the cut text."""
    n = state.stop_at
    assert n is not None
    return dataclasses.replace(
        out,
        token_ids=out.token_ids[:n],
        logprobs=out.logprobs[:n] if out.logprobs is not None else None,
        text=state.text,
        new_token_ids=new_ids,
        new_text=new_text,
        finish_reason="stop" if out.finished else None,
        error=None if out.finished else out.error,
    )
