"""A prompt-cache timing audit across tenants, in the style of Gu et al. (Auditing Prompt Caching
in LM APIs): two-sample Kolmogorov-Smirnov tests over TTFT samples.

How isolation works here: the ingress derives each tenant's cache namespace on the server
(HMAC of the tenant id under a secret kept in Redis; a client's `cache_salt` is ignored), the
block hashes the router looks up in the prefix directory are chained from that namespace, and
the engine's ShadowRadix keeps one tree per namespace. So the realistic attack is the one an
outsider can run: the attacker sends the victim's exact prompt text (a system prompt it guessed)
and times its first token.

Per sample, the victim first caches a fresh 1024-token system prompt (8 pages); then, in random
order: the attacker probes it (the prompt plus a question), the victim probes it (its own cache:
a hit), and the attacker probes a fresh prompt of the same length that nobody cached (a miss).
  * victim's own probe vs cold: the distributions must differ clearly (p < 1e-6);
  * attacker's probe of the victim's prompt vs cold: they must not (p > 0.05). Under isolation the
    two are one distribution, whose p-value is uniform: a single test would fail 5% of sound runs,
    so a p at or below 0.05 draws a second batch, whose own test must pass (0.25% of sound runs
    fail). A leak gives p-values like the own-cache one, far below 0.05, in both.
  * a second batch is drawn too when the own-cache test misses 1e-6 (a 2-core machine shared with
    other work stalls a few hits now and then): it is then run on both batches together.
The audit runs through the cache-affinity router and the prefix directory on the 2-replica model
(device tier), and on the model whose compressed rows live on the HiSparse host tier. The usage
each probe reports is checked too: cached tokens for the victim's probes, none for the attacker's.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any

import pytest
import tokenizers

from antumbra.replicas.model.tokenizer import v4_tokenizer_file
from tests.faults.app import HOST_MODEL, MODEL, FaultApp
from tests.faults.ks import ks_2samp
from tests.faults.load import Outcome, request, sentence, summary

SAMPLES = 20  # fully separated samples of 20 give p = Q(sqrt(10)) = 2e-9
PROMPT_TOKENS = 1024  # BOS included: 8 whole pages
OWN_P_BELOW = 1e-6
CROSS_P_ABOVE = 0.05


_V4 = tokenizers.Tokenizer.from_file(str(v4_tokenizer_file()))  # the tiny models' tokenizer


def system_prompt(rng: random.Random) -> str:
    """Random words, as few as make the prompt (with BOS) `PROMPT_TOKENS` V4 tokens or a few more."""
    words = [f"{rng.random():.12f} you are a careful assistant.", *sentence(rng, 1200).split()]

    def tokens(n: int) -> int:
        return 1 + len(_V4.encode(" ".join(words[:n]), add_special_tokens=False).ids)

    lo, hi = 1, len(words)
    while lo < hi:  # the shortest prefix of the words that is long enough
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if tokens(mid) >= PROMPT_TOKENS else (mid + 1, hi)
    return " ".join(words[:lo])


async def _audit(app: FaultApp, model: str, rng: random.Random, samples: int) -> dict[str, list[Outcome]]:
    victim, attacker = app.client("victim"), app.client("attacker")
    got: dict[str, list[Outcome]] = {"own": [], "cross": [], "cold": []}
    try:
        for _ in range(samples):
            primed = system_prompt(rng)
            prime = await request(victim, "victim", primed, 1, stream=False, model=model)
            assert prime.ok, summary([prime])
            probes = [
                ("own", victim, "victim", primed),
                ("cross", attacker, "attacker", primed),
                ("cold", attacker, "attacker", system_prompt(rng)),
            ]
            rng.shuffle(probes)
            for kind, client, tenant, prompt in probes:
                question = f" Question {rng.randrange(10**6)}: what is the answer?"
                out = await request(client, tenant, prompt + question, 4, stream=True, model=model)
                assert out.ok and out.ttft is not None, summary([out])
                got[kind].append(out)
    finally:
        await victim.close()
        await attacker.close()
    return got


@pytest.mark.parametrize("model", [MODEL, HOST_MODEL], ids=["directory-device-tier", "hisparse-host-tier"])
def test_a_tenant_cannot_time_another_tenants_cache(app: FaultApp, model: str) -> None:
    rng = random.Random(f"audit:{model}")
    host_before = _host_tier_reads(app, model)
    first = asyncio.run(_audit(app, model, rng, SAMPLES))
    _, p_own = ks_2samp(_ttfts(first, "own"), _ttfts(first, "cold"))
    d_cross, p_cross = ks_2samp(_ttfts(first, "cross"), _ttfts(first, "cold"))
    first_p = (p_own, p_cross)
    if p_own >= OWN_P_BELOW or p_cross <= CROSS_P_ABOVE:  # a second batch (module docstring)
        second = asyncio.run(_audit(app, model, rng, SAMPLES))
        pooled = {k: first[k] + second[k] for k in first}
        _, p_own = ks_2samp(_ttfts(pooled, "own"), _ttfts(pooled, "cold"))
        if p_cross <= CROSS_P_ABOVE:
            d_cross, p_cross = ks_2samp(_ttfts(second, "cross"), _ttfts(second, "cold"))
        first = pooled
    got = first
    assert all(o.cached_tokens >= PROMPT_TOKENS for o in got["own"]), [o.cached_tokens for o in got["own"]]
    assert all(o.cached_tokens == 0 for o in got["cross"] + got["cold"])
    assert p_own < OWN_P_BELOW, f"own cache hits not separable from misses: p = {p_own:.3g} {first_p}"
    assert p_cross > CROSS_P_ABOVE, f"the attacker's probes differ from misses: p = {p_cross:.3g} {first_p}"
    if model == HOST_MODEL:  # the probes' decode steps read compressed rows through the host tier
        assert _host_tier_reads(app, model) > host_before
    med = {k: statistics.median(_ttfts(got, k)) * 1000 for k in got}
    print(f"\naudit {model}: {len(got['own'])} samples each; median TTFT own {med['own']:.0f} ms, cross "
          f"{med['cross']:.0f} ms, cold {med['cold']:.0f} ms; KS own-vs-cold p = {p_own:.2g}, cross-vs-cold "
          f"D = {d_cross:.2f} p = {p_cross:.2f} (first batch p = {first_p[0]:.2g} / {first_p[1]:.2f})")


def _ttfts(got: dict[str, list[Outcome]], kind: str) -> list[float]:
    return [o.ttft for o in got[kind] if o.ttft is not None]


def _host_tier_reads(app: FaultApp, model: str) -> float:
    stats: list[dict[str, Any]] = [s["stats"] for s in app.replicas(model)]
    return sum(s["host_tier_hits"] + s["host_tier_misses"] for s in stats)
