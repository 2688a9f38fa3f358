"""A reference speculative decoder: the MTP chain drafts k tokens, one target forward over the k + 1
positions verifies them, the rejection rule (`rejection.py`) decides, repeat.

No paging and nothing cached on the target's side: every target call is `plain_forward` over the whole
sequence so far, so what it computes for a position never depends on rejected drafts. The MTP block
keeps its window in an `MTPWindowCache`; each round it first recomputes, with the target's verified
states, every position its chain had drafted from its own output streams. This is the oracle the
engine's speculation is checked against: greedy output equals `plain_decode`'s, tokens and logprobs.

Accept length: the tokens one verify step emits (the accepted drafts plus the correction or bonus
token), averaged over the verify steps; the token sampled from the prompt's forward is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.model import DeepseekV4
from ..model.mtp import MTPBlock, MTPWindowCache
from ..sampling_params import SamplingParams
from .plain_forward import plain_forward
from .rejection import sample_draft, verify

GREEDY = SamplingParams(temperature=0.0)
_MTP_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]  # generated
    logprobs: list[float]  # the target's log-probability of each (its raw logits' log-softmax)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    verify_steps: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step, the correction / bonus token included."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def _logprob(logits: torch.Tensor, token: int) -> float:
    return float(torch.log_softmax(logits.float(), dim=-1)[token])


@torch.no_grad()
def plain_decode(model: DeepseekV4, prompt: list[int], max_tokens: int,
                 params: SamplingParams = GREEDY, seed: int = 0) -> Decoded:
    """Token by token, a full target forward per token; draws as `verify` with no drafts."""
    seq = list(prompt)
    tokens: list[int] = []
    logprobs: list[float] = []
    while len(tokens) < max_tokens:
        logits = plain_forward(model, seq).logits[-1]
        token = _draw(logits, params, seed, len(tokens))
        tokens.append(token)
        logprobs.append(_logprob(logits, token))
        seq.append(token)
    return Decoded(tokens, logprobs)


@torch.no_grad()
def speculative_decode(model: DeepseekV4, mtp: MTPBlock, prompt: list[int], max_tokens: int, k: int,
                       params: SamplingParams = GREEDY, seed: int = 0) -> Decoded:
    """`max_tokens` tokens of `prompt` drafting `k` tokens a round with the MTP chain."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    cfg = model.config
    prefill = plain_forward(model, list(prompt))
    first = _draw(prefill.logits[-1], params, seed, 0)
    seq = list(prompt) + [first]
    tokens, logprobs = [first], [_logprob(prefill.logits[-1], first)]
    hidden = prefill.streams  # [len(seq) - 1, n, D]: every position's but the last
    cache = MTPWindowCache(cfg, 1, max(_MTP_CHUNK_TOKENS, k + 1), hidden.dtype, hidden.device)
    verified = 0  # positions the MTP block has computed from the target's own states
    drafted = accepted = steps = 0
    while len(tokens) < max_tokens:
        logits, streams = _catch_up(model, mtp, cache, hidden, seq, verified)
        verified = len(seq) - 1
        drafts: list[int] = []
        q: list[torch.Tensor] = []
        for j in range(k):
            if j:
                pos = verified + j - 1
                out = mtp(model, streams, torch.tensor([[drafts[-1]]]).to(hidden.device), [pos], cache)
                logits, streams = out.logits[0, -1], out.streams[:, -1:]
            token, probs = sample_draft(logits[None], [params], [seed], [len(tokens) + j])
            drafts.append(int(token[0]))
            q.append(probs[0])
        target = plain_forward(model, seq + drafts)
        rows = target.logits[len(seq) - 1 :]  # [k + 1, V]
        verdict = verify(rows[None], torch.stack(q)[None], torch.tensor([drafts]).to(rows.device), [params],
                         [seed], [len(tokens)])
        n = int(verdict.num_accepted[0])
        emitted = verdict.tokens[0, : n + 1].tolist()
        tokens += emitted
        logprobs += [_logprob(rows[j], t) for j, t in enumerate(emitted)]
        seq += emitted
        hidden = target.streams[: len(seq) - 1]
        drafted, accepted, steps = drafted + k, accepted + n, steps + 1
    return Decoded(tokens[:max_tokens], logprobs[:max_tokens], drafted, accepted, steps)


def _draw(logits: torch.Tensor, params: SamplingParams, seed: int, counter: int) -> int:
    """One token from logits [V] as `verify` draws with no drafts (the request's counter-th token)."""
    empty = logits.new_zeros(1, 0, logits.shape[0])
    verdict = verify(logits[None, None], empty, torch.zeros(1, 0, dtype=torch.long, device=logits.device),
                     [params], [seed], [counter])
    return int(verdict.tokens[0, 0])


def _catch_up(model: DeepseekV4, mtp: MTPBlock, cache: MTPWindowCache, hidden: torch.Tensor, seq: list[int],
              start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MTP block over positions start .. len(seq) - 2 from the target's states hidden [>= len(seq)
    - 1, n, D] -> (logits [V] of the next draft, the block's output streams [1, 1, n, D] at the last)."""
    stop = len(seq) - 1
    ids = torch.tensor(seq, device=hidden.device)
    out = None
    for s in range(start, stop, cache.max_chunk_tokens):
        e = min(stop, s + cache.max_chunk_tokens)
        out = mtp(model, hidden[None, s:e], ids[None, s + 1 : e + 1], [s], cache)
    if out is None:
        raise ValueError("no verified position to draft from")
    return out.logits[0, -1], out.streams[:, -1:]
