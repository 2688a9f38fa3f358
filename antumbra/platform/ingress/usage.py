"""Durable usage metering: each request's tokens, per tenant, model and hour, in Redis, exactly once.

A finished request (however it ended) hands one `UsageRecord` to the ingress's `UsageMeter`
(`usage_meter`), which writes it with one Lua script (`write_records`): `SET <done key> NX` (the
request's idempotency key, kept `DONE_TTL_S`), and only if that was new, `HINCRBY` of the hour's
counters and an index entry; in the same script the request's open entry, if any, is deleted. A
write retried after a lost reply, or replayed after an ingress restart, finds the done key and adds
nothing, so each request counts once.

A stream also has an open entry while it runs (`usage_open`): what its client has been sent so far,
rewritten as it goes. An ingress that dies leaves its streams' entries open; any ingress's sweeper
(`usage_sweep`) folds an entry whose heartbeat has stopped into the hour's counters, under the same
done key, so a stream counts once whether its ingress closed it or a sweeper folded it.

Redis layout (one hash tag per tenant, so each script's keys share a cluster slot):
  {<prefix>:usage:<tenant>}:h:<hour epoch>:<model>   hash: requests, prompt_tokens, cached_tokens,
                                                     completion_tokens, reasoning_tokens (no TTL:
                                                     billing data is never evicted by volatile-lru)
  {<prefix>:usage:<tenant>}:hours                    sorted set of "<hour epoch>:<model>" by hour
  {<prefix>:usage:<tenant>}:done:<request id>        the idempotency key (TTL `DONE_TTL_S`)
  {<prefix>:usage:<tenant>}:open:<request id>        a running stream's usage so far (hash: model,
                                                     at_s and the counters but `requests`)
  {<prefix>:usage:<tenant>}:open                     sorted set of open request ids by heartbeat
                                                     (Redis's own clock, milliseconds)
  <prefix>:usage:tenants                             set of tenants that have usage
  <prefix>:usage:sweep                               the sweepers' lease (one sweeps at a time)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HOUR_S = 3600
DONE_TTL_S = 7 * 24 * HOUR_S  # far beyond any retry or restart that could replay a record
COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")

# KEYS: done key, hour hash, hours index, open entry, open index. ARGV: done TTL, index member,
# hour epoch, request id, then the counter name / increment pairs. Returns 1 when counted now, 0
# when the request was counted before (by this write's earlier try, or by a sweeper's fold).
_RECORD = """
redis.call('DEL', KEYS[4])
redis.call('ZREM', KEYS[5], ARGV[4])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 5, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class UsageRecord:
    """What one request used: prompt tokens read (of which `cached_tokens` from the prefix cache) and
    completion tokens the client received (of which `reasoning_tokens` were reasoning)."""

    request_id: str
    tenant_id: str
    model: str
    finished_at_s: float  # Unix time: it picks the hour
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0

    @property
    def hour_s(self) -> int:
        return int(self.finished_at_s // HOUR_S) * HOUR_S

    def counters(self) -> dict[str, int]:
        return {"requests": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "reasoning_tokens": self.reasoning_tokens}


@dataclass(frozen=True)
class UsageKeys:
    """The Redis key names of the module docstring."""

    prefix: str = "antumbra"

    def tag(self, tenant_id: str) -> str:
        return f"{{{self.prefix}:usage:{tenant_id}}}"

    def hour(self, tenant_id: str, member: str) -> str:
        """The hash of one index member, `"<hour epoch>:<model>"`."""
        return f"{self.tag(tenant_id)}:h:{member}"

    def hours(self, tenant_id: str) -> str:
        return f"{self.tag(tenant_id)}:hours"

    def done(self, tenant_id: str, request_id: str) -> str:
        return f"{self.tag(tenant_id)}:done:{request_id}"

    def open_entry(self, tenant_id: str, request_id: str) -> str:
        return f"{self.tag(tenant_id)}:open:{request_id}"

    def open_index(self, tenant_id: str) -> str:
        return f"{self.tag(tenant_id)}:open"

    @property
    def sweep_lease(self) -> str:
        return f"{self.prefix}:usage:sweep"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:usage:tenants"


def index_member(hour_s: int, model: str) -> str:
    return f"{hour_s}:{model}"


def split_member(member: str) -> tuple[int, str]:
    hour, _, model = member.partition(":")
    return int(hour), model


async def write_records(redis: Any, keys: UsageKeys, records: list[UsageRecord]) -> list[bool]:
    """Write (close) `records` in one pipelined round trip; per record, whether it was counted now
    (False: it had been counted before). Safe to repeat: a record counts once whatever happens."""
    pipe = redis.pipeline(transaction=False)
    for rec in records:
        member = index_member(rec.hour_s, rec.model)
        args: list[Any] = [DONE_TTL_S, member, rec.hour_s, rec.request_id]
        for name, value in rec.counters().items():
            args += [name, value]
        pipe.eval(_RECORD, 5, keys.done(rec.tenant_id, rec.request_id), keys.hour(rec.tenant_id, member),
                  keys.hours(rec.tenant_id), keys.open_entry(rec.tenant_id, rec.request_id),
                  keys.open_index(rec.tenant_id), *args)
    for tenant in sorted({rec.tenant_id for rec in records}):
        pipe.sadd(keys.tenants, tenant)
    results = await pipe.execute()
    return [bool(r) for r in results[: len(records)]]
