"""GCRA rate limits and leased concurrency slots against a real redis-server.

Most tests run on the Redis clock with slow rates, so that timing slack cannot
change an outcome, and assert on the reported waits; a few wait for real on a
condition with a deadline. The property tests drive the same Lua script with a
simulated clock and require it to agree exactly with GCRA in fractions.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from fractions import Fraction
from typing import TypeVar

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from antumbra.platform.ingress.ratelimit import (
    MAX_UNITS,
    ConcurrencyLimiter,
    ConcurrencyLimitExceeded,
    Decision,
    Limit,
    RateLimiter,
    retry_after_header,
)
from antumbra.platform.launch.redis_server import LocalRedis

T = TypeVar("T")
EPOCH_S = 1_700_000_000.0  # simulated clocks start at a realistic Unix time, to exercise float precision


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with LocalRedis() as server:
        yield server.url


def run(url: str, body: Callable[[Redis], Awaitable[T]]) -> T:
    async def main() -> T:
        client = Redis.from_url(url, socket_timeout=2)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def fresh_key() -> str:
    return f"{{t-{uuid.uuid4().hex[:12]}}}"


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, poll_s: float = 0.01
) -> float:
    """Poll `predicate` until true; return the seconds waited, or fail at the deadline."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


class SimClock:
    def __init__(self) -> None:
        self.now_s = EPOCH_S

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


# --- GCRA on the Redis clock ------------------------------------------------------------------


def test_burst_then_deny_with_a_sensible_retry_after(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        # 6/min: one unit every 10 s; burst 3.
        decisions = [await limiter.check(key, 6, burst=3) for _ in range(4)]
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert [d.remaining for d in decisions] == [2, 1, 0, 0]
        assert all(d.limit == 6 and not d.never for d in decisions)
        assert all(d.retry_after_s == 0 for d in decisions[:3])
        denied = decisions[3]
        # The next unit fits once the first one has drained: 10 s after the burst, less elapsed time.
        assert 9.0 < denied.retry_after_s <= 10.0
        assert 29.0 < denied.reset_after_s <= 30.0
        assert retry_after_header([denied]) == 10
        # The key expires once its debt is paid.
        assert 29_000 < await client.pttl(f"antumbra:ratelimit:{key}") <= 31_000

    run(redis_url, body)


def test_default_burst_is_one_minute_of_rate(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        decisions = [await limiter.check(key, 5) for _ in range(6)]
        assert [d.allowed for d in decisions] == [True] * 5 + [False]
        assert 11.0 < decisions[-1].retry_after_s <= 12.0

    run(redis_url, body)


def test_two_keys_are_independent(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        a, b = fresh_key(), fresh_key()
        assert (await limiter.check(a, 1)).allowed
        assert not (await limiter.check(a, 1)).allowed
        fresh = await limiter.check(b, 1)
        assert fresh.allowed and fresh.remaining == 0

    run(redis_url, body)


def test_limiters_on_two_clients_share_one_budget(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        other = Redis.from_url(redis_url)
        try:
            key = fresh_key()
            first, second = RateLimiter(client), RateLimiter(other)
            results = [await (first if i % 2 else second).check(key, 10, burst=4) for i in range(6)]
            assert sum(d.allowed for d in results) == 4
        finally:
            await other.aclose()

    run(redis_url, body)


def test_token_charge_is_corrected_by_refund_and_adjust(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        tpm = 60  # one token a second: nothing visible drains during the test
        # Admission charges prompt + max_tokens = 50.
        admitted = await limiter.check(key, tpm, cost=50)
        assert admitted.allowed and admitted.remaining == 10
        assert not (await limiter.check(key, tpm, cost=20)).allowed
        # The request used 30 tokens: refund 20.
        refunded = await limiter.refund(key, tpm, 20)
        assert refunded.allowed and refunded.remaining == 30
        assert (await limiter.check(key, tpm, cost=20)).allowed
        # It used more than estimated: charge 25 more, never refused, even into debt.
        overdrawn = await limiter.adjust(key, tpm, 25)
        assert overdrawn.allowed and overdrawn.remaining == 0
        denied = await limiter.check(key, tpm, cost=1)
        # Debt is now 50 + 20 - 20 + 25 = 75 s against a tolerance of 60 s: 16 s until one token fits.
        assert not denied.allowed and 15.0 < denied.retry_after_s <= 16.0

    run(redis_url, body)


def test_a_refund_never_banks_more_than_a_full_burst(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        await limiter.check(key, 60, cost=5, burst=10)
        full = await limiter.refund(key, 60, 1000, burst=10)
        assert full.remaining == 10 and full.reset_after_s == 0
        assert await client.exists(f"antumbra:ratelimit:{key}") == 0
        assert (await limiter.check(key, 60, cost=10, burst=10)).allowed
        assert not (await limiter.check(key, 60, cost=1, burst=10)).allowed

    run(redis_url, body)


def test_a_cost_above_the_burst_is_never_allowed_and_charges_nothing(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        never = await limiter.check(key, 100, cost=101)
        assert not never.allowed and never.never and never.retry_after_s == math.inf
        assert never.remaining == 100
        assert (await limiter.check(key, 100, cost=100)).allowed
        # After the burst is spent, a cost above it is still reported as never, not as a wait.
        assert (await limiter.check(key, 100, cost=101)).never
        with pytest.raises(ValueError):
            await limiter.check(key, 100, cost=-1)
        with pytest.raises(ValueError):
            await limiter.check(key, 0)
        with pytest.raises(ValueError):
            await limiter.check(key, 10, burst=0)

    run(redis_url, body)


def test_check_all_is_all_or_nothing(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        tenant = fresh_key()
        rpm, tpm = f"{tenant}:rpm", f"{tenant}:tpm"
        ok = await limiter.check_all([Limit(rpm, 10), Limit(tpm, 1000, cost=900)])
        assert all(d.allowed for d in ok) and (ok[0].remaining, ok[1].remaining) == (9, 100)
        # The token limit refuses; the request limit had room but is not charged.
        refused = await limiter.check_all([Limit(rpm, 10), Limit(tpm, 1000, cost=200)])
        assert [d.allowed for d in refused] == [True, False]
        assert refused[0].remaining == 9 and refused[1].remaining == 100
        assert retry_after_header(refused) == math.ceil(refused[1].retry_after_s)
        assert (await limiter.check(rpm, 10)).remaining == 8

    run(redis_url, body)


def test_waiting_the_retry_after_is_enough(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        assert (await limiter.check(key, 600, burst=1)).allowed  # one every 100 ms
        denied = await limiter.check(key, 600, burst=1)
        assert not denied.allowed and 0 < denied.retry_after_s <= 0.1
        await asyncio.sleep(denied.retry_after_s)
        assert (await limiter.check(key, 600, burst=1)).allowed

    run(redis_url, body)


def test_idle_keys_expire(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        assert (await limiter.check(key, 60_000, cost=50)).allowed  # 50 ms of debt
        redis_key = f"antumbra:ratelimit:{key}"
        assert await client.exists(redis_key)

        async def gone() -> bool:
            return await client.exists(redis_key) == 0

        await wait_until(gone, timeout_s=2.0)
        assert (await limiter.check(key, 60_000, cost=1)).remaining == 59_999

    run(redis_url, body)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rate=st.integers(1, 120),
    burst=st.integers(1, 8),
    costs=st.lists(st.integers(1, 4), min_size=1, max_size=25),
)
def test_on_the_redis_clock_admissions_never_exceed_burst_plus_drain(
    redis_url: str, rate: int, burst: int, costs: list[int]
) -> None:
    async def body(client: Redis) -> None:
        limiter = RateLimiter(client)
        key = fresh_key()
        start = time.monotonic()
        admitted = 0
        for cost in costs:
            d = await limiter.check(key, rate, cost=cost, burst=burst)
            admitted += cost if d.allowed else 0
            # The client's clock brackets every script run, so it overstates the Redis-side window,
            # up to the 1 ms the script's millisecond clock can add.
            elapsed = time.monotonic() - start
            assert admitted <= burst + (elapsed + 0.001) * rate / 60 + 1e-9
            assert d.never == (cost > burst)
            if not d.allowed and not d.never:
                assert 0 < d.retry_after_s <= cost * 60 / rate + 0.001

    run(redis_url, body)


def test_limits_work_again_after_a_redis_restart() -> None:
    async def body() -> None:
        with LocalRedis() as server:
            client = Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
            try:
                limiter = RateLimiter(client)
                assert not (await limiter.check("k", 1, cost=2, burst=2)).remaining
                server.kill()
                # The caller sees the outage (and decides what to do), rather than a silent allow.
                with pytest.raises(redis.ConnectionError):
                    await limiter.check("k", 1)
                server.start()
                # The restarted server has lost both the state and the loaded script.
                after = await limiter.check("k", 1, cost=2, burst=2)
                assert after.allowed and after.remaining == 0
            finally:
                await client.aclose()

    asyncio.run(body())


# --- GCRA on a simulated clock, against an exact model ---------------------------------------


class ExactGCRA:
    """GCRA in exact rational arithmetic on a millisecond clock: what the Lua script must compute."""

    def __init__(self, rate: int, burst: int) -> None:
        self.interval = Fraction(60_000, rate)  # ms per unit
        self.burst = burst
        self.tau = burst * self.interval
        self.tat: Fraction | None = None

    def debt(self, now: int) -> Fraction:
        return max((Fraction(now) if self.tat is None else self.tat) - now, Fraction(0))

    def check(self, now: int, cost: int) -> tuple[bool, Fraction]:
        """(allowed, retry_after_ms), without charging."""
        new_debt = self.debt(now) + cost * self.interval
        return new_debt <= self.tau, max(new_debt - self.tau, Fraction(0))

    def charge(self, now: int, cost: int) -> None:
        self.tat = now + max(self.debt(now) + cost * self.interval, Fraction(0))

    def remaining(self, now: int) -> int:
        return max(math.floor((self.tau - self.debt(now)) / self.interval), 0)


ops = st.lists(
    st.tuples(
        st.integers(0, 3_000),  # ms to advance before the op
        st.sampled_from(["check", "check", "check", "adjust"]),
        st.integers(-6, 6),  # cost (absolute value for checks), delta for adjusts
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rate=st.one_of(st.integers(1, 10_000), st.integers(1, MAX_UNITS)), burst=st.integers(1, 70), steps=ops)
def test_script_matches_exact_gcra_on_a_simulated_clock(
    redis_url: str, rate: int, burst: int, steps: list[tuple[int, str, int]]
) -> None:
    async def body(client: Redis) -> None:
        clock = SimClock()
        limiter = RateLimiter(client, clock=clock)
        model = ExactGCRA(rate, burst)
        key = fresh_key()
        # (time ms, units charged, whether an admission) of each allowed check and each adjust.
        charges: list[tuple[int, int, bool]] = []
        for advance_ms, op, amount in steps:
            clock.advance(advance_ms / 1000)
            now = round(clock() * 1000)
            if op == "adjust":
                d = await limiter.adjust(key, rate, amount, burst=burst)
                model.charge(now, amount)
                charges.append((now, amount, False))
                assert d.allowed
            else:
                cost = abs(amount)
                d = await limiter.check(key, rate, cost=cost, burst=burst)
                allowed, retry_ms = model.check(now, cost)
                assert d.never == (cost > burst)
                if d.never:
                    assert not d.allowed and d.retry_after_s == math.inf
                    continue
                assert d.allowed == allowed
                assert d.retry_after_s == math.ceil(retry_ms) / 1000
                if allowed:
                    model.charge(now, cost)
                    charges.append((now, cost, True))
            assert d.remaining == model.remaining(now)
            assert d.reset_after_s == math.ceil(model.debt(now)) / 1000

        # The GCRA bound: over any run of operations that ends in an admission, the units charged
        # (admissions plus corrections, refunds negative) are at most burst + elapsed * rate / 60.
        for i in range(len(charges)):
            total = 0
            for j in range(i, len(charges)):
                total += charges[j][1]
                window_min = Fraction(charges[j][0] - charges[i][0], 60_000)
                if charges[j][2]:
                    assert total <= burst + window_min * rate

    run(redis_url, body)


@pytest.mark.parametrize("rate", [1, 7, 124, 127, 999_983, 7_000_000, MAX_UNITS])
@pytest.mark.parametrize("burst", [1, 7, 64])
def test_exact_bursts_and_intervals_at_awkward_rates(redis_url: str, rate: int, burst: int) -> None:
    async def body(client: Redis) -> None:
        clock = SimClock()
        limiter = RateLimiter(client, clock=clock)
        key = fresh_key()
        decisions = [await limiter.check(key, rate, burst=burst) for _ in range(burst + 1)]
        assert [d.allowed for d in decisions] == [True] * burst + [False]
        # After a whole number of milliseconds, exactly the units drained by then fit, not one more.
        wait_ms = 3 * math.ceil(60_000 / rate)
        fits = min(burst, wait_ms * rate // 60_000)
        clock.advance(wait_ms / 1000)
        more = [await limiter.check(key, rate, burst=burst) for _ in range(fits + 1)]
        assert [d.allowed for d in more] == [True] * fits + [False]

    run(redis_url, body)


def test_decision_is_frozen() -> None:
    d = Decision(allowed=True, retry_after_s=0.0, limit=1, remaining=0, reset_after_s=1.0)
    with pytest.raises(AttributeError):
        d.allowed = False  # type: ignore[misc]


# --- concurrency ------------------------------------------------------------------------------


def test_acquire_up_to_the_limit_and_release(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = ConcurrencyLimiter(client, lease_s=30)
        key = fresh_key()
        leases = [await limiter.acquire(key, 3) for _ in range(3)]
        assert all(lease is not None for lease in leases)
        assert len({lease.token for lease in leases if lease}) == 3
        assert await limiter.acquire(key, 3) is None
        assert await limiter.in_use(key) == 3
        assert leases[0] is not None and await limiter.release(leases[0])
        assert not await limiter.release(leases[0])  # twice is harmless
        assert await limiter.in_use(key) == 2
        assert await limiter.acquire(key, 3) is not None
        assert await limiter.acquire(key, 3) is None
        # A raised limit admits more at once; another key is independent.
        assert await limiter.acquire(key, 4) is not None
        assert await limiter.acquire(fresh_key(), 1) is not None
        assert 0 < await client.pttl(f"antumbra:concurrency:{key}") <= 30_000
        with pytest.raises(ValueError):
            await limiter.acquire(key, 0)

    run(redis_url, body)


def test_a_crashed_holders_slot_comes_back_when_its_lease_lapses(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = ConcurrencyLimiter(client, lease_s=0.25)
        key = fresh_key()
        # Two holders that never release, as if their ingress died.
        assert await limiter.acquire(key, 2) and await limiter.acquire(key, 2)
        assert await limiter.acquire(key, 2) is None
        taken: list[object] = []

        async def slot_free() -> bool:
            lease = await limiter.acquire(key, 2)
            taken.append(lease)
            return lease is not None

        waited = await wait_until(slot_free, timeout_s=3.0)
        assert 0.15 < waited < 3.0

    run(redis_url, body)


def test_lease_expiry_and_renewal_on_a_simulated_clock(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        clock = SimClock()
        limiter = ConcurrencyLimiter(client, lease_s=10, clock=clock)
        key = fresh_key()
        lease = await limiter.acquire(key, 1)
        assert lease is not None and lease.expires_at_s == pytest.approx(EPOCH_S + 10)
        clock.advance(9.9)
        assert await limiter.acquire(key, 1) is None
        renewed = await limiter.renew(lease)
        assert renewed is not None and renewed.expires_at_s == pytest.approx(EPOCH_S + 19.9)
        clock.advance(9.9)
        assert await limiter.acquire(key, 1) is None  # renewal kept it
        clock.advance(0.2)
        assert await limiter.in_use(key) == 0
        assert await limiter.renew(lease) is None  # lapsed: cannot be revived
        assert not await limiter.release(lease)
        assert await limiter.acquire(key, 1) is not None

    run(redis_url, body)


def test_hold_renews_in_the_background_and_releases_on_exit(redis_url: str) -> None:
    async def body(client: Redis) -> None:
        limiter = ConcurrencyLimiter(client, lease_s=0.15)
        key = fresh_key()
        async with limiter.hold(key, 1) as lease:
            # Held for several lease lengths, the slot stays taken.
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                assert await limiter.acquire(key, 1) is None
                await asyncio.sleep(0.05)
            with pytest.raises(ConcurrencyLimitExceeded, match="1 requests in flight"):
                async with limiter.hold(key, 1):
                    pass
        assert await limiter.in_use(key) == 0
        assert not await limiter.release(lease)
        with pytest.raises(RuntimeError):
            async with limiter.hold(key, 1):
                raise RuntimeError("request failed")
        assert await limiter.in_use(key) == 0

    run(redis_url, body)
