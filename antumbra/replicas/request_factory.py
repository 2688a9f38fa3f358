"""Turning what a caller sends into a validated `Request`, before it touches any engine state.

Bad input raises `InvalidRequestError` naming the parameter and changes nothing. `build` may run
on any thread: the only state it keeps (the id counter and the seed generator for requests that
bring no seed) is behind a lock.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import torch

from antumbra.config import ModelConfig

from .errors import InvalidRequestError
from .request import NO_ROLLOUT, KVHandoff, Request, RolloutSpec
from .sampling_params import SamplingParams
from .structured.grammars import GrammarError
from .structured.matcher import GrammarMatcher
from .structured.vocabulary import GrammarVocabulary
from .tenancy import DEFAULT_TENANCY, Tenancy
from .validation import Prompt, prompt_token_ids, validate


class RequestFactory:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any | None, max_model_len: int, seed: int
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._seeds = random.Random(seed)  # seeds of requests that bring none
        self._ids = 0
        self._lock = threading.Lock()
        self.grammar_vocabulary = (
            GrammarVocabulary(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
            if tokenizer is not None else None
        )

    def build(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        tenancy: Tenancy = DEFAULT_TENANCY,
        namespace: str = "default",
        want_prompt_logits: bool = False,
        want_prompt_hidden: bool = False,
        replay_experts: torch.Tensor | None = None,
        export_kv_from: int | None = None,
        export_draft_streams: bool = False,
    ) -> Request:
        """`namespace` scopes prefix reuse: requests share cached pages only within one namespace
        (the platform derives it from the tenant, never from the client); `tenancy` is whom the
        scheduler serves it for (scheduling_policy.py). `replay_experts`
        [S', L, k] gives the experts of the first S' positions (routing replay, R3). With
        `export_kv_from`, `export_draft_streams` sends the last window's streams along with the KV
        (for a speculating decode engine's drafter, `KVHandoff.stream_window`)."""
        params = params or SamplingParams()
        token_ids = prompt_token_ids(prompt, self.tokenizer)
        validate(token_ids, params, self.model_config.vocab_size, self.max_model_len)
        rollout = self._rollout(want_prompt_logits, want_prompt_hidden, replay_experts)
        grammar = self._grammar(params.grammar) if params.grammar is not None else None
        with self._lock:
            if request_id is None:
                request_id, self._ids = f"req-{self._ids}", self._ids + 1
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            detokenizer=self._detokenizer(token_ids, params),
            priority=priority,
            tenancy=tenancy,
            rollout=rollout,
            namespace=namespace,
            handoff=self._handoff(export_kv_from, export_draft_streams),
            grammar=grammar,
        )
        request.max_total_tokens = min(len(token_ids) + params.max_tokens, self.max_model_len)
        return request

    def _handoff(self, export_kv_from: int | None, export_draft_streams: bool) -> KVHandoff | None:
        if export_kv_from is None:
            return None
        window = self.model_config.sliding_window if export_draft_streams else 0
        return KVHandoff(export_kv_from, stream_window=window)

    def _rollout(
        self, want_prompt_logits: bool, want_prompt_hidden: bool, replay_experts: torch.Tensor | None
    ) -> RolloutSpec:
        if replay_experts is not None:
            self._check_replay(replay_experts)
        elif not (want_prompt_logits or want_prompt_hidden):
            return NO_ROLLOUT
        return RolloutSpec(want_prompt_logits, want_prompt_hidden, replay_experts)

    def _check_replay(self, experts: torch.Tensor) -> None:
        cfg = self.model_config
        want = (cfg.num_layers, cfg.num_experts_per_tok)
        if experts.dim() != 3 or tuple(experts.shape[1:]) != want:
            raise InvalidRequestError(
                f"replayed experts must be [tokens, {want[0]}, {want[1]}], got {tuple(experts.shape)}",
                "routed_experts")
        if experts.numel() and (int(experts.min()) < -1 or int(experts.max()) >= cfg.num_experts):
            raise InvalidRequestError(f"replayed expert ids must be in [0, {cfg.num_experts}) or -1",
                                      "routed_experts")

    def _grammar(self, grammar: str) -> GrammarMatcher:
        if self.grammar_vocabulary is None:
            raise InvalidRequestError("structured output needs the checkpoint's tokenizer", "grammar")
        try:
            return GrammarMatcher(self.grammar_vocabulary.get(), grammar)
        except GrammarError as exc:
            raise InvalidRequestError(str(exc), "grammar") from None

    def _detokenizer(self, token_ids: list[int], params: SamplingParams) -> Any | None:
        if self.tokenizer is None:
            return None
        from .detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, token_ids, params)
