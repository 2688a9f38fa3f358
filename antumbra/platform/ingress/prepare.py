"""From a parsed OpenAI request to a `Generation`: tokens, context check, sampling parameters, block hashes.

The block hashes are computed in the cache namespace `f"{model}:{tenant.cache_namespace}"`, the
same string the engine gets as `namespace`, so the engine's cache and the prefix directory agree
and one tenant's entries never match another's prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from antumbra.cachestore.block_hash import block_hashes
from antumbra.platform.ingress.chat_setup import ChatSetup, chat_setup
from antumbra.platform.ingress.errors import context_error
from antumbra.platform.ingress.generation import Generation
from antumbra.platform.ingress.openai_errors import invalid
from antumbra.platform.ingress.openai_requests import Kind
from antumbra.platform.ingress.served_model import ServedModel
from antumbra.platform.ingress.structured import request_grammar
from antumbra.platform.ingress.tenant_spec import Tenant
from antumbra.platform.messages import GenerateRequest
from antumbra.replicas.sampling_params import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


def sampling_params(
    body: Any, max_tokens: int, logprobs: int | None, vocab_size: int, grammar: str | None = None
) -> SamplingParams:
    outside = sorted(t for t in body.logit_bias or {} if t >= vocab_size)
    if outside:
        raise invalid(f"logit_bias: token ids outside the vocabulary [0, {vocab_size}): {outside[:5]}",
                      "logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            return_routed_experts=body.return_routed_experts,
            grammar=grammar,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=tuple((body.logit_bias or {}).items()),
            min_p=body.min_p or 0.0,
        )
    except ValueError as exc:
        # SamplingParams names the parameter first: "top_p must be in (0, 1], got 0".
        name = str(exc).split(" ", 1)[0]
        raise invalid(str(exc), name if name.isidentifier() else None) from None


def _tokenize(
    kind: Kind, model: ServedModel, body: Any, chat: ChatSetup | None, info: dict[str, Any]
) -> tuple[str, list[int]]:
    """The prompt's text and token ids (chat: through the chat encoding); 400 past the context."""
    max_len, vocab = info["max_model_len"], info["vocab_size"]
    if chat is not None:
        try:
            tokenizer = model.tokenizer
            text = tokenizer.apply_chat_template(chat.messages, tools=chat.tools, thinking=chat.thinking)
        except Exception as exc:  # the encoding refuses e.g. an unsupported role order
            raise invalid(f"messages: {exc}", "messages") from None
        ids = model.tokenizer.encode(text)
    elif isinstance(body.prompt, str):
        text, ids = body.prompt, model.tokenizer.encode(body.prompt)
    else:
        ids = list(body.prompt)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise invalid(f"prompt: token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
        text = model.tokenizer.decode(ids, skip_special_tokens=False)
    if len(ids) >= max_len:
        raise context_error(max_len, len(ids), None, "messages" if kind == "chat" else "prompt")
    return text, ids


def _output_limits(
    kind: Kind, body: Any, room: int, default_max_tokens: int, prompt_len: int, max_len: int
) -> tuple[int, int | None]:
    """`max_tokens` (defaulted to fit the `room` left in the context) and the logprobs to report."""
    if kind == "chat":
        requested = body.output_limit
        max_tokens = requested if requested is not None else min(default_max_tokens, room)
        top = (body.top_logprobs or 0) if body.logprobs else None
    else:
        requested = body.max_tokens
        max_tokens = requested if requested is not None else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        top = body.logprobs
    if max_tokens > room:
        param = "max_completion_tokens" if kind == "chat" and body.max_completion_tokens else "max_tokens"
        raise context_error(max_len, prompt_len, max_tokens, param)
    return max_tokens, top


async def prepare(
    kind: Kind,
    model: ServedModel,
    tenant: Tenant,
    body: Any,
    info: dict[str, Any],
    default_max_tokens: int,
    started: float,
) -> Generation:
    """Tokenize, check the context, build the sampling parameters and the block hashes.

    `info` is the model's `get_model_info()`; `default_max_tokens` caps chat requests that name
    no limit (completions default to OpenAI's 16).
    """
    namespace = f"{model.name}:{tenant.cache_namespace}"
    chat = chat_setup(model, body) if kind == "chat" else None

    def tokenize() -> tuple[str, list[int], list[int], str | None]:
        # Off the event loop: long prompts take real time to tokenize and hash, schemas to compile.
        grammar = request_grammar(body, model.tokenizer, thinking=chat is not None and chat.thinking)
        text, ids = _tokenize(kind, model, body, chat, info)
        return text, ids, block_hashes(ids, info["page_size"], namespace), grammar

    text, token_ids, hashes, grammar = await asyncio.to_thread(tokenize)
    max_len = info["max_model_len"]
    max_tokens, top = _output_limits(
        kind, body, max_len - len(token_ids), default_max_tokens, len(token_ids), max_len
    )
    params = sampling_params(body, max_tokens, top, info["vocab_size"], grammar)
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    gen = GenerateRequest(
        request_id=response_id,
        token_ids=token_ids,
        params=params,
        namespace=namespace,
        priority=tenant.priority,
        block_hashes=hashes,
        prompt=text,
        chat_messages=chat.routing_messages() if chat else None,
        tenant_id=tenant.id,
        n=body.n,
        tenancy=tenant.tenancy(),
    )
    return Generation(kind, model, tenant, body, gen, response_id, int(time.time()), started, top, chat)
