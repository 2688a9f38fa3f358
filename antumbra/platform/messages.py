"""What the platform's processes hand each other: the ingress to a replica, the replica back.

The ingress calls `ModelServer.generate` through a streaming handle with one `GenerateRequest`
(the request router, in the ingress's process, reads the same object as the handle call's first
argument). The replica streams `StreamItem`s back: plain dicts, so nothing engine-specific
crosses the process boundary. A served request yields `Delta`s until one has a `finish_reason`;
a request the replica cannot serve yields one `ErrorItem` instead.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict, final

import numpy as np

from antumbra.replicas.sampling_params import SamplingParams
from antumbra.replicas.tenancy import DEFAULT_TENANCY, Tenancy

if TYPE_CHECKING:  # the ingress imports this module and must not pay for torch (only replicas hold tensors)
    import torch


@dataclass
class GenerateRequest:
    """One generation, as the ingress hands it to a replica (and the request router sees it).

    `block_hashes` are the prompt's page hashes in `namespace` (the cache-affinity router reads
    them from `pending_request.args[0]`); `prompt` / `messages` are the text Ray's
    `PrefixCacheAffinityRouter` routes on. `tenancy` carries the tenant's weight, priority class
    and SLO targets into the engine's scheduler (`replicas/scheduling_policy.py`).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    namespace: str
    priority: int = 0
    block_hashes: list[int] = field(default_factory=list)
    prompt: str = ""
    chat_messages: list[dict[str, str]] | None = None
    tenant_id: str = ""
    n: int = 1  # choices for the prompt (`replica/choices.py`: the prompt is computed once)
    tenancy: Tenancy = DEFAULT_TENANCY  # whom the engine's scheduler serves it for (weight, class, SLOs)

    @property
    def messages(self) -> list[dict[str, str]] | str:
        """The chat messages, or the prompt text for a completion (never None: routers probe it)."""
        return self.chat_messages if self.chat_messages is not None else self.prompt


@dataclass(frozen=True)
class WeightsUpdate:
    """New weights for every replica of a model (`POST /admin/models/{name}/weights`).

    The ingress sends it again and again, each time naming the replicas already `updated`, until a
    replica answers that was updated before; the cache-affinity router sends it to a replica not
    in `updated` while one is left. A replica already at `version` answers at once.
    """

    path: str  # a checkpoint directory every replica can read
    version: str
    updated: frozenset[str] = frozenset()


# A replica's SLO outcomes per tenant, as `ModelServer.replica_state` reports them under "slo":
# {tenant: {"window": counts, "total": counts}}, counts keyed by these names (replica/slo.py).
SLO_COUNT_NAMES = ("requests", "met", "ttft_requests", "ttft_met", "tpot_requests", "tpot_met")


def add_slo_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for name in SLO_COUNT_NAMES:
        into[name] = into.get(name, 0) + counts.get(name, 0)


def slo_attainment(counts: dict[str, int]) -> dict[str, float | None]:
    """Fractions met, overall and per target (None where no request had that target)."""

    def frac(met: str, of: str) -> float | None:
        return counts[met] / counts[of] if counts.get(of) else None

    return {"attainment": frac("met", "requests"), "ttft_attainment": frac("ttft_met", "ttft_requests"),
            "tpot_attainment": frac("tpot_met", "tpot_requests")}


@dataclass(frozen=True)
class ReplicaQuery:
    """Ask every replica of a model for its state (`GET /admin/models/{name}/replicas`).

    Routed like `WeightsUpdate`: the ingress sends it again and again, naming the replicas that
    already answered in `updated`, until one answers twice; the cache-affinity router sends it to
    a replica not in `updated` while one is left. `check_integrity` also runs the engine's
    invariant checks there (they read the whole cache under the engine's lock).
    """

    updated: frozenset[str] = frozenset()
    check_integrity: bool = False


TokenPairs = list[tuple[int, float]]  # one token's (token id, logprob) pairs, best first


@final
class Delta(TypedDict):
    """A request's new output since its previous item; `completion_tokens` counts all so far."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenPairs] | None  # per new token (pairs, not a dict: int keys do not survive JSON)
    finish_reason: str | None
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    weights_version: str  # the weights every token so far was made with
    routed_experts: RoutedExperts | None  # on the last delta of a request that asked for them (R3)
    index: NotRequired[int]  # the choice this delta belongs to (n > 1); absent: choice 0
    drafted_tokens: NotRequired[int]  # speculative decoding: draft tokens verified so far
    accepted_tokens: NotRequired[int]  # ... and accepted


@final
class RoutedExperts(TypedDict):
    """R3's `[num_tokens, num_moe_layers, top_k]` int16 experts in a compact JSON form.

    `data` is the base64 of the array's bytes, little-endian, row-major: 2 bytes per entry
    instead of ~4 characters per number in a JSON list. Rows are every token the model read:
    the prompt, then each generated token but the last.
    """

    shape: list[int]
    dtype: str  # "int16"
    encoding: str  # "base64"
    data: str


def encode_routed_experts(experts: torch.Tensor) -> RoutedExperts:
    """`experts`: `[N, L, k]` int16 on any device."""
    import torch

    array = experts.detach().to("cpu", torch.int16).contiguous().numpy().astype("<i2", copy=False)
    return {"shape": list(array.shape), "dtype": "int16", "encoding": "base64",
            "data": base64.b64encode(array.tobytes()).decode("ascii")}


def decode_routed_experts(encoded: RoutedExperts | dict) -> torch.Tensor:
    """The `[N, L, k]` int16 CPU tensor back from `encode_routed_experts`'s form (what a client does)."""
    if encoded.get("dtype") != "int16" or encoded.get("encoding") != "base64":
        raise ValueError(f"routed experts in an unknown form: dtype={encoded.get('dtype')!r}, "
                         f"encoding={encoded.get('encoding')!r}")
    import torch

    raw = base64.b64decode(encoded["data"])
    array = np.frombuffer(raw, dtype="<i2").reshape(encoded["shape"])
    return torch.from_numpy(array.astype(np.int16))


@final
class ErrorDetail(TypedDict):
    """OpenAI's error fields."""

    message: str
    type: str
    param: str | None
    code: str | None


@final
class ErrorItem(TypedDict):
    """The only item of a request the replica could not serve."""

    status: int  # 400: the engine refused the request; 500: it failed in the engine; 503: see below
    error: ErrorDetail


# The code of a 503 item from a replica whose engine has stopped: nothing of the request ran there,
# so the ingress may retry it on another replica (Serve replaces this one: its health check fails).
REPLICA_UNAVAILABLE = "replica_unavailable"
ENGINE_ERROR = "engine_error"  # the code of a 500 item: the request failed inside the engine


StreamItem = Delta | ErrorItem


def error_item(
    status: int,
    message: str,
    param: str | None,
    type_: str = "invalid_request_error",
    code: str | None = None,
) -> ErrorItem:
    return {"status": status, "error": {"message": message, "type": type_, "param": param, "code": code}}
