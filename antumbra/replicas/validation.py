"""Checking a request before it touches any engine state: bad input raises and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import InvalidRequestError
from .sampling_params import SamplingParams

Prompt = str | Sequence[int]


def prompt_token_ids(prompt: Prompt, tokenizer: Any | None) -> list[int]:
    """A prompt (text, or token ids) as a list of ints; raises InvalidRequestError."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids", "prompt")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and _only(prompt, int):
        # The common case, checked at C speed: the element-by-element checks below cost a long prompt
        # more than its first prefill step would wait for.
        return list(prompt)
    if isinstance(prompt, Sequence | torch.Tensor):
        if not all(hasattr(t, "__index__") and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        return [int(t.__index__()) for t in prompt]  # type: ignore[union-attr]
    raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")


def _only(items: list[Any], kind: type) -> bool:
    """Is every item exactly of type `kind` (not a subclass: bool is not a token id)?"""
    return set(map(type, items)) <= {kind}


def validate(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequestError naming the parameter when the request cannot be served."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams", "params")
    if not token_ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        raise InvalidRequestError(
            f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "prompt"
        )
    if len(token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(token_ids)} tokens but this model's context is {max_model_len} tokens "
            "(prompt plus at least one generated token must fit)",
            "prompt",
        )
    try:
        params.validate_for(vocab_size)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "stop_token_ids") from exc


def as_prompt_list(prompts: Sequence[Prompt] | Prompt) -> list[Prompt]:
    """One prompt (a string or a list of ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(issubclass(kind, int) for kind in set(map(type, items))):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]
