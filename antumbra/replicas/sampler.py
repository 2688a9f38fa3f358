"""Batched next-token sampling with per-request settings.

Every row of a decode batch can carry different `SamplingParams`. The sampler
splits the batch into greedy and random rows, applies temperature, top-k and
top-p to the random rows as whole tensors (per-row thresholds, no loop over the
vocabulary), and draws with the exponential-race trick: `argmax(p / E)` with
`E ~ Exponential(1)` i.i.d. is a draw from `p`. The race lets each seeded row
take its noise from its own `torch.Generator`, so a seeded request produces the
same tokens whatever else shares its batch and wherever its row sits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from antumbra.replicas.sampling_params import SamplingParams

# Below this temperature logits / T overflows fp32 for ordinary logit ranges, and the
# distribution is a point mass to fp32 precision anyway, so such rows are decoded greedily.
_GREEDY_TEMPERATURE = 1e-5

_default_generators: dict[torch.device, torch.Generator] = {}


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    # Per row: {chosen token: logprob, each top-N token: logprob}, or None when not requested.
    logprobs: list[dict[int, float] | None]


def default_generator(device: torch.device | str) -> torch.Generator:
    """The generator shared by all unseeded rows on `device` (randomly seeded once per process)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gen = _default_generators.get(device)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.seed()
        _default_generators[device] = gen
    return gen


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A request's private generator when it has a seed; None means "use the default generator"."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(params.seed)
    return gen


class Sampler:
    """Stateless apart from the module's default generators; one instance can serve every batch."""

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        output_token_counts: Sequence[int],
        eos_token_ids: Sequence[int],
    ) -> SamplerOutput:
        """Pick one token per row.

        logits: [B, V] float32 (other float dtypes are upcast); not modified.
        generators[i] must live on logits.device; None draws from `default_generator`.
        output_token_counts[i]: tokens already generated for row i (drives `min_tokens`).
        eos_token_ids: the model's end-of-sequence ids, blocked during `min_tokens`.
        """
        batch = _check_inputs(logits, params, generators, output_token_counts)
        if batch == 0:
            return SamplerOutput([], [])
        raw = logits.float()  # [B, V] float32
        masked = _mask_min_tokens(raw, params, output_token_counts, eos_token_ids)

        token_ids = torch.empty(batch, dtype=torch.long, device=raw.device)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature < _GREEDY_TEMPERATURE]
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_TEMPERATURE]
        if greedy_rows:
            # torch.argmax returns the first maximal index, which makes ties resolve to the lowest id.
            token_ids[_index(greedy_rows, raw)] = _rows(masked, greedy_rows).argmax(dim=-1)
        if random_rows:
            token_ids[_index(random_rows, raw)] = _sample_random(
                _rows(masked, random_rows),
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
        tokens = token_ids.tolist()
        return SamplerOutput(tokens, _gather_logprobs(raw, params, tokens))


def _check_inputs(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    output_token_counts: Sequence[int],
) -> int:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a [B, V] float tensor, got {tuple(logits.shape)} {logits.dtype}")
    batch = logits.shape[0]
    for name, seq in (
        ("params", params),
        ("generators", generators),
        ("output_token_counts", output_token_counts),
    ):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries for a batch of {batch} rows")
    return batch


def _index(rows: list[int], like: Tensor) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def _rows(x: Tensor, rows: list[int]) -> Tensor:
    """x[rows]; x itself (not a copy) when rows is the whole batch, so callers must not write to it."""
    if len(rows) == x.shape[0]:
        return x
    return x[_index(rows, x)]


def _mask_min_tokens(
    logits: Tensor,
    params: Sequence[SamplingParams],
    output_token_counts: Sequence[int],
    eos_token_ids: Sequence[int],
) -> Tensor:
    """logits with EOS and stop tokens at -inf for rows still short of `min_tokens`.

    logits: [B, V] float32. Returns the input itself when no row needs masking.
    """
    vocab = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, (p, count) in enumerate(zip(params, output_token_counts, strict=True)):
        if count >= p.min_tokens:
            continue
        banned = set(eos_token_ids).union(p.stop_token_ids)
        for t in banned:
            if not 0 <= t < vocab:
                raise ValueError(f"stop/eos token id {t} is outside the vocabulary [0, {vocab})")
        row_idx.extend([i] * len(banned))
        tok_idx.extend(banned)
    if not row_idx:
        return logits
    out = logits.clone()
    out[_index(row_idx, out), _index(tok_idx, out)] = float("-inf")
    return out


def _sample_random(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> Tensor:
    """One draw per row from softmax(top_k_top_p(logits / T)).

    logits: [R, V] float32, not modified. Returns [R] int64 token ids.
    """
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]  # a fresh tensor that the filters below may edit in place
    _apply_top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)  # [R, V] float32
    noise = _exponential_noise(probs, generators)  # [R, V] float32
    return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    """Set logits outside each row's top-k / top-p nucleus to -inf, in place.

    logits: [R, V] float32, already divided by temperature.
    """
    vocab = logits.shape[1]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if not rows:
        return
    sub = _rows(logits, rows)  # [F, V]
    # A stable descending sort puts tied logits in index order, so top_k=1 keeps exactly the
    # token greedy decoding would pick.
    sorted_logits, order = sub.sort(dim=-1, descending=True, stable=True)  # [F, V], [F, V]
    positions = torch.arange(vocab, device=logits.device)

    top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    k = torch.tensor(top_k, device=logits.device)
    sorted_logits.masked_fill_(positions[None, :] >= k[:, None], float("-inf"))

    top_p = [params[i].top_p for i in rows]
    if any(p < 1 for p in top_p):
        # Rows with top_p == 1 get an unreachable threshold: fp32 cumulative sums can
        # creep past 1.0 and would otherwise drop the tail.
        threshold = torch.tensor([p if p < 1 else float("inf") for p in top_p], device=logits.device)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [F, V] probability of all better tokens
        # Keep a token while the better ones have not yet reached top_p: that is the smallest
        # prefix whose cumulative probability is >= top_p. The top token always survives.
        drop = mass_before >= threshold[:, None]
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, float("-inf"))

    filtered = torch.empty_like(sub).scatter_(-1, order, sorted_logits)
    if len(rows) == logits.shape[0]:
        logits.copy_(filtered)
    else:
        logits[_index(rows, logits)] = filtered


def _exponential_noise(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Exponential(1) noise shaped like probs; a seeded row reads only its own generator.

    probs: [R, V] float32. Returns [R, V] float32, strictly positive.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        shared = default_generator(probs.device)
        if len(unseeded) == len(generators):
            noise.exponential_(generator=shared)
        else:
            noise[_index(unseeded, probs)] = torch.empty(
                len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device
            ).exponential_(generator=shared)
    for i, gen in enumerate(generators):
        if gen is not None:
            # Always exactly V draws per step, so a request's stream of noise depends only on its
            # seed and how many tokens it has sampled.
            noise[i].exponential_(generator=gen)
    # A zero draw would turn p / E into inf or nan; clamping keeps the race well defined.
    return noise.clamp_min_(torch.finfo(probs.dtype).tiny)


def _gather_logprobs(
    raw: Tensor, params: Sequence[SamplingParams], tokens: list[int]
) -> list[dict[int, float] | None]:
    """Logprobs from the unprocessed logits, which is what clients compare with a reference model.

    raw: [B, V] float32.
    """
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    logprobs = torch.log_softmax(_rows(raw, rows), dim=-1)  # [L, V] float32
    chosen = _index([tokens[i] for i in rows], raw)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    n_max = min(max(params[i].logprobs or 0 for i in rows), raw.shape[1])
    top_lp: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if n_max > 0:
        values, ids = logprobs.topk(n_max, dim=-1)  # [L, n_max] each, best first
        top_lp, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        entry = {tokens[i]: chosen_lp[j]}
        entry.update(zip(top_ids[j][:n], top_lp[j][:n], strict=True))
        out[i] = entry
    return out
