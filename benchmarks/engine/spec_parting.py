"""Where a speculating run's greedy tokens part from the plain run's, and whether they part at a tie.

Greedy speculation is exact in exact arithmetic: the verify step keeps a draft only where it is the
target's argmax. In bfloat16 a verify step's k + 1 rows per request give the GEMMs other shapes than
a plain step's, so two candidates whose logits are closer than the rounding can swap, and from there
on the two runs decode different texts. The random slice's logits are nearly flat, so such ties are
common. A run that parts from the plain run is still correct when, at the first token where it parts,
the plain run's own log-probabilities put its token within `tolerance_nats` of the plain run's
choice; a broken verify step instead picks tokens the target ranks far below (or not in its top
candidates at all). Nothing after the first parting can be compared: each run continues its own text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# bfloat16 keeps 8 bits of mantissa: logits of magnitude ~10 round to ~0.04, and the verify and plain
# steps reach them through different reduction orders.
TIE_TOLERANCE_NATS = 0.1


def first_parting(plain: Sequence[int], speculating: Sequence[int]) -> int | None:
    """The first position where the two token lists differ (None: equal as far as both go)."""
    for position, (a, b) in enumerate(zip(plain, speculating, strict=False)):
        if a != b:
            return position
    return None


def partings(plain: Sequence[Sequence[int]], plain_logprobs: Sequence[Sequence[dict[int, float]]],
             speculating: Sequence[Sequence[int]], tolerance_nats: float = TIE_TOLERANCE_NATS
             ) -> list[dict[str, Any]]:
    """Each request whose speculating tokens part from the plain ones: its index, the position, the
    two tokens and the gap in the plain run's log-probabilities (None where the speculating token is
    not among the plain run's top candidates), and `tie` (the gap within `tolerance_nats`).

    plain / speculating: each request's greedy token ids; plain_logprobs: per request, per position,
    the plain run's log-probability of its top candidates (token id -> log-probability, the chosen
    token included), as `RequestOutput.logprobs` holds them."""
    out: list[dict[str, Any]] = []
    for index, (want, logprobs, got) in enumerate(zip(plain, plain_logprobs, speculating, strict=True)):
        position = first_parting(want, got)
        if position is None:
            continue
        ranked = logprobs[position]
        chosen = ranked[want[position]]
        gap = chosen - ranked[got[position]] if got[position] in ranked else None
        out.append({"request": index, "position": position, "plain_token": want[position],
                    "speculating_token": got[position], "gap_nats": gap,
                    "tie": gap is not None and gap <= tolerance_nats})
    return out


def plain_logprobs(engine: Any, batch_prompts: list[list[int]], new_tokens: int, top: int = 5
                   ) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """One untimed plain greedy run of the batch with each token's top-`top` log-probabilities ->
    (tokens, logprobs) per request, as `api_decode_step_ms`'s longer call decodes them."""
    from antumbra import SamplingParams

    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=1 + new_tokens, temperature=0.0,
                                                          ignore_eos=True, logprobs=top))
    return [list(o.token_ids) for o in outs], [list(o.logprobs or []) for o in outs]


def agreement(references: dict[tuple[int, ...], list[int]], reference_logprobs: dict[tuple[int, ...], Any],
              batch_prompts: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """The check gating a speculating run: its tokens equal the plain run's, or part from them only
    at ties (`partings`). `reference_logprobs` maps each prompt to (tokens, logprobs) of the plain
    run with log-probabilities; a prompt whose logged run decoded other tokens than the timed plain
    run cannot judge a parting, which then counts as no tie."""
    keys = [tuple(p) for p in batch_prompts]
    equal = all(references[k] == t for k, t in zip(keys, tokens, strict=True))
    if equal:
        return {"tokens_equal_plain": True, "tokens_agree": True, "partings": []}
    logged = [reference_logprobs[k] for k in keys]
    same_reference = [lt == references[k] for (lt, _), k in zip(logged, keys, strict=True)]
    parted = partings([references[k] for k in keys], [lp for _, lp in logged], tokens)
    for one in parted:
        one["tie"] = one["tie"] and same_reference[one["request"]]
    return {"tokens_equal_plain": False, "tokens_agree": all(p["tie"] for p in parted), "partings": parted}
