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
    so a p at or below 0.05 draws one fresh sample, which must pass (0.25% of sound runs fail). A
    leak gives p-values like the own-cache one, far below 0.05, in both.
The audit runs through the cache-affinity router and the prefix directory on the 2-replica model
(device tier), and on the model whose compressed rows live on the HiSparse host tier. The usage
each probe reports is checked too: cached tokens for the victim's probes, none for the attacker's.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tests.faults.app import HOST_MODEL, MODEL, FaultApp
from tests.faults.ks import ks_2samp
from tests.faults.load import Outcome, request, sentence, summary

SAMPLES = 20  # fully separated samples of 20 give p = Q(sqrt(10)) = 2e-9
PROMPT_CHARS = 1023  # + BOS = 1024 tokens: 8 whole pages
OWN_P_BELOW = 1e-6
CROSS_P_ABOVE = 0.05


def system_prompt(rng: random.Random) -> str:
    text = f"{rng.random():.12f} you are a careful assistant. " + sentence(rng, 200)
    return text[:PROMPT_CHARS]


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
    got = asyncio.run(_audit(app, model, rng, SAMPLES))
    ttft = {k: [o.ttft for o in v if o.ttft is not None] for k, v in got.items()}
    assert all(o.cached_tokens >= PROMPT_CHARS for o in got["own"]), [o.cached_tokens for o in got["own"]]
    assert all(o.cached_tokens == 0 for o in got["cross"] + got["cold"])
    _, p_own = ks_2samp(ttft["own"], ttft["cold"])
    d_cross, p_cross = ks_2samp(ttft["cross"], ttft["cold"])
    first_p = p_cross
    if p_cross <= CROSS_P_ABOVE:  # one fresh sample (module docstring)
        again = asyncio.run(_audit(app, model, rng, SAMPLES))
        cross = [o.ttft for o in again["cross"] if o.ttft is not None]
        cold = [o.ttft for o in again["cold"] if o.ttft is not None]
        d_cross, p_cross = ks_2samp(cross, cold)
    assert p_own < OWN_P_BELOW, f"own cache hits not separable from misses: p = {p_own:.3g}"
    assert p_cross > CROSS_P_ABOVE, (
        f"the attacker's probes differ from misses: p = {p_cross:.3g} ({first_p:.3g})")
    if model == HOST_MODEL:  # the probes' decode steps read compressed rows through the host tier
        assert _host_tier_reads(app, model) > host_before
    med = {k: sorted(v)[len(v) // 2] * 1000 for k, v in ttft.items()}
    print(f"\naudit {model}: median TTFT own {med['own']:.0f} ms, cross {med['cross']:.0f} ms, cold "
          f"{med['cold']:.0f} ms; KS own-vs-cold p = {p_own:.2g}, cross-vs-cold D = {d_cross:.2f} "
          f"p = {p_cross:.2f} (first sample p = {first_p:.2f})")


def _host_tier_reads(app: FaultApp, model: str) -> float:
    stats: list[dict[str, Any]] = [s["stats"] for s in app.replicas(model)]
    return sum(s["host_tier_hits"] + s["host_tier_misses"] for s in stats)
