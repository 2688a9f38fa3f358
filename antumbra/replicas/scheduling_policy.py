"""The order in which the scheduler serves requests: who is admitted, who gets the step's token
budget first, and who is preempted when the pools run out.

The scheduler asks a policy three things each step: a queue over some requests that hands them
out best first (`queue(...).pop()`, re-deciding after each charge), the service each scheduled
chunk gave (`charge`), and a victim among running requests (`victim`). It tells the policy when a
request arrives (`arrived`, with the tenants that have work then). Policies read a clock only
for slack, so tests drive them with a fake one.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Iterable

from .request import Request

Clock = Callable[[], float]


def deadline_s(request: Request) -> float:
    """When the request's next token is due under its tenant's SLO (inf without one).

    Before the first token: arrival + TTFT target. After it: the first token's time + TPOT target
    x tokens produced so far, i.e. the time the next token must exist to keep the mean on target.
    """
    tenancy = request.tenancy
    if request.record.first_token_time_s is None:
        return math.inf if tenancy.ttft_slo_s is None else request.arrival_time_s + tenancy.ttft_slo_s
    if tenancy.tpot_slo_s is None:
        return math.inf
    return request.record.first_token_time_s + tenancy.tpot_slo_s * request.num_output_tokens


class PickQueue(abc.ABC):
    @abc.abstractmethod
    def pop(self) -> Request | None:
        """The request to serve next (None when empty); called again after each charge."""


class _ListQueue(PickQueue):
    def __init__(self, ordered: list[Request]) -> None:
        self._rest = ordered[::-1]

    def pop(self) -> Request | None:
        return self._rest.pop() if self._rest else None


class SchedulingPolicy(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def arrived(self, request: Request, active_tenants: set[str]) -> None:
        """`request` joins the queue; `active_tenants` had requests waiting or running before it."""

    @abc.abstractmethod
    def charge(self, request: Request, prompt_tokens: int, decode_tokens: int) -> None:
        """A chunk of `request` was scheduled: it computes `prompt_tokens` new prompt positions and
        samples `decode_tokens` tokens."""

    @abc.abstractmethod
    def queue(self, requests: Iterable[Request]) -> PickQueue:
        """The requests, handed out best first."""

    @abc.abstractmethod
    def victim(self, requests: Iterable[Request]) -> Request:
        """The running request to preempt first (requests is not empty)."""


class FifoPolicy(SchedulingPolicy):
    """First come, first served, priorities first.

    Algorithm: serve in order of (-priority, arrival time); preempt the last in that order (the
    lowest priority, newest request). Tenants, weights and SLOs are ignored: a tenant that sends
    more tokens gets more of the engine.
    """

    name = "fifo"

    @staticmethod
    def _key(request: Request) -> tuple[int, float]:
        return (-request.priority, request.arrival_time_s)

    def arrived(self, request: Request, active_tenants: set[str]) -> None:
        pass  # arrival time alone orders

    def charge(self, request: Request, prompt_tokens: int, decode_tokens: int) -> None:
        pass  # service received does not change the order

    def queue(self, requests: Iterable[Request]) -> PickQueue:
        return _ListQueue(sorted(requests, key=self._key))

    def victim(self, requests: Iterable[Request]) -> Request:
        return max(requests, key=self._key)


class FairSharePolicy(SchedulingPolicy):
    """Fair share by virtual token counters (Sheng et al., "Fairness in Serving Large Language
    Models", OSDI 2024), under priorities and priority classes, ordered by slack within a tenant.

    Algorithm: each tenant `t` has a counter `c_t` of the service it received, in weighted tokens:
    a scheduled chunk adds `(prefill_cost x new prompt positions + decode_cost x sampled tokens) /
    weight_t`. When a request arrives from a tenant with no request waiting or running, its counter
    is lifted to `max(c_t, min of the active tenants' counters)`, so a tenant banks no credit while
    idle; when no tenant is active at all, every counter restarts at 0. Requests are served in
    order of (-priority, priority class, c_tenant, deadline, arrival), re-read after every chunk:
    the least-served tenant with work goes next, and inside a tenant the request with the least
    slack (`deadline_s`: the SLO time its next token is due) goes first. The preemption victim is
    the last in that order: the lowest priority, `batch` before `interactive`, the most-served
    tenant, the most slack.
    """

    name = "fair_share"

    def __init__(
        self, prefill_cost: float = 1.0, decode_cost: float = 2.0, clock: Clock = time.monotonic
    ) -> None:
        if prefill_cost < 0 or decode_cost < 0:
            raise ValueError("token costs must be >= 0")
        self.prefill_cost = prefill_cost
        self.decode_cost = decode_cost
        self.clock = clock
        self.counters: dict[str, float] = {}

    def counter(self, tenant_id: str) -> float:
        return self.counters.get(tenant_id, 0.0)

    def slack_s(self, request: Request) -> float:
        """Seconds until the request's next token is due (negative: late; inf: no SLO)."""
        return deadline_s(request) - self.clock()

    def arrived(self, request: Request, active_tenants: set[str]) -> None:
        tenant = request.tenancy.tenant_id
        if not active_tenants:
            self.counters.clear()
        elif tenant not in active_tenants:
            floor = min(self.counter(t) for t in active_tenants)
            self.counters[tenant] = max(self.counter(tenant), floor)

    def charge(self, request: Request, prompt_tokens: int, decode_tokens: int) -> None:
        tenancy = request.tenancy
        cost = self.prefill_cost * prompt_tokens + self.decode_cost * decode_tokens
        self.counters[tenancy.tenant_id] = self.counter(tenancy.tenant_id) + cost / tenancy.weight

    @staticmethod
    def _in_tenant(request: Request) -> tuple[int, int, float, float]:
        return (-request.priority, request.tenancy.class_rank, deadline_s(request), request.arrival_time_s)

    def key(self, request: Request) -> tuple[int, int, float, float, float]:
        """Where `request` stands now (smaller goes first)."""
        prio, rank, deadline, arrival = self._in_tenant(request)
        return (prio, rank, self.counter(request.tenancy.tenant_id), deadline, arrival)

    def queue(self, requests: Iterable[Request]) -> PickQueue:
        return _FairQueue(self, requests)

    def victim(self, requests: Iterable[Request]) -> Request:
        return max(requests, key=self.key)


class _FairQueue(PickQueue):
    """Each tenant's requests in their order inside the tenant; `pop` takes the best head."""

    def __init__(self, policy: FairSharePolicy, requests: Iterable[Request]) -> None:
        self._policy = policy
        by_tenant: dict[str, list[Request]] = {}
        for request in requests:
            by_tenant.setdefault(request.tenancy.tenant_id, []).append(request)
        # Reversed, so each tenant's next request is at the end of its list.
        self._tenants = {
            t: sorted(rs, key=FairSharePolicy._in_tenant, reverse=True) for t, rs in by_tenant.items()
        }

    def pop(self) -> Request | None:
        if not self._tenants:
            return None
        if len(self._tenants) == 1:  # one tenant (each step of a single-tenant batch): no keys to compare
            tenant = next(iter(self._tenants))
        else:
            tenant = min(self._tenants, key=lambda t: self._policy.key(self._tenants[t][-1]))
        rest = self._tenants[tenant]
        request = rest.pop()
        if not rest:
            del self._tenants[tenant]
        return request


POLICIES: dict[str, type[SchedulingPolicy]] = {
    FifoPolicy.name: FifoPolicy,
    FairSharePolicy.name: FairSharePolicy,
}


def make_scheduling_policy(name: str) -> SchedulingPolicy:
    return POLICIES[name]()
