"""Soak with Locust as the load: the platform's own redis-server SIGKILLed twice, usage checked to the token.

    python -m benchmarks.soak_locust_cpu [--minutes 10] [--kills 2] [--users 6] [--name soak-locust]

The app: `local_platform` as `antumbra serve` runs it (real Ray Serve, the tiny model, and a
redis-server the platform starts, persists and supervises). The load: `loadtest/run_headless.py`
(Locust, headless, through `benchmarks/locust_load.py`) with two tenants of different weights
(share of users, and the fair-share weight in their tenant spec where the platform has one) and
request shapes (completion length, message length). Locust's CSVs, report and summary are kept in
`benchmarks/results/<name>-locust/` (one current run; history is git's).

Faults: the platform's redis-server SIGKILLed `--kills` times, evenly spread over the run. After
each: how long until it answers again (the supervisor's bound is 5 s), then one request per
tenant (each tenant is still served).

Checked at the end, per tenant: the usage the platform recorded (`GET /admin/usage`) against the
sum of the `usage` objects the clients received (Locust's per-tenant totals plus the probes):
requests, prompt, cached and completion tokens; `lost` is clients minus platform, `doubled`
platform minus clients, both 0 when metering is exact. JSON: `benchmarks/results/<name>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.records import RESULTS_DIR, provenance
from benchmarks.locust_load import REPO, locust_results, start_locust

MODEL = "tiny"
BACK_BOUND_S = 5.0
COUNTS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")
# Two tenants: users per tenant by `weight`, each user at `rps`; their own request shapes.
TENANTS = {
    "gold": {"load": {"rps": 1.0, "weight": 2.0, "max_tokens": 24, "message_words": 8}, "share": 3},
    "bronze": {"load": {"rps": 0.5, "weight": 1.0, "max_tokens": 8, "message_words": 40}, "share": 1},
}


def tenant_spec(tenant: str) -> dict[str, Any]:
    """The admin API body: the fair-share weight too where the tenant spec has one."""
    from antumbra.platform.ingress.tenant_spec import TenantSpec

    spec: dict[str, Any] = {"id": tenant}
    if "weight" in TenantSpec.model_fields:
        spec["weight"] = TENANTS[tenant]["share"]
    return spec


def probe(url: str, key: str, tag: str) -> dict[str, Any]:
    """One plain completion; its status and usage."""
    body = {"model": MODEL, "prompt": f"probe {tag}", "max_tokens": 4, "temperature": 0}
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=60)
    except httpx.HTTPError as exc:
        return {"status": None, "error": repr(exc), "usage": None}
    return {"status": r.status_code, "usage": r.json().get("usage") if r.status_code == 200 else None}


def kill_and_wait(redis: Any, url: str, keys: dict[str, str], index: int) -> dict[str, Any]:
    """SIGKILL the platform's redis-server; time until it answers again; probe every tenant."""
    from antumbra.platform.launch.redis_server import HOST, ping

    killed = redis.pid
    os.kill(killed, signal.SIGKILL)
    t0 = time.monotonic()
    while not (redis.pid not in (None, killed) and ping(HOST, redis.port)):
        if time.monotonic() - t0 > 60:
            return {"back_s": None, "probes": {}}
        time.sleep(0.02)
    back_s = time.monotonic() - t0
    probes = {t: probe(url, key, f"after kill {index}") for t, key in keys.items()}
    return {"back_s": round(back_s, 3), "probes": probes}


def client_totals(report: dict[str, Any], kills: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per tenant, what the clients received: Locust's totals plus the probes' usage."""
    totals = {t: {k: int(report.get("tenants", {}).get(t, {}).get(k, 0)) for k in COUNTS} for t in TENANTS}
    for kill in kills:
        for tenant, answer in kill["probes"].items():
            usage = answer.get("usage")
            if usage:
                sums = totals[tenant]
                sums["requests"] += 1
                sums["prompt_tokens"] += usage["prompt_tokens"]
                sums["completion_tokens"] += usage["completion_tokens"]
                sums["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return totals


def platform_totals(url: str, admin: dict[str, str]) -> dict[str, dict[str, int]]:
    answer = httpx.get(f"{url}/admin/usage", headers=admin, timeout=30).json()["totals"]
    return {t: {k: int(answer.get(t, {}).get(k, 0)) for k in COUNTS} for t in TENANTS}


def compare(clients: dict[str, dict[str, int]], platform: dict[str, dict[str, int]]) -> dict[str, Any]:
    out = {}
    for tenant in TENANTS:
        diff = {k: clients[tenant][k] - platform[tenant][k] for k in COUNTS}
        out[tenant] = {"clients": clients[tenant], "platform": platform[tenant],
                       "lost": {k: max(v, 0) for k, v in diff.items()},
                       "doubled": {k: max(-v, 0) for k, v in diff.items()}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--name", default="soak-locust", help="results: <name>.json and <name>-locust/")
    args = parser.parse_args()

    from antumbra.platform.launch.redis_server import free_port
    from antumbra.platform.launch.serve_cli import local_platform
    from antumbra.replicas.model.tiny import TinyModelSpec, make_tiny_checkpoint

    duration_s = max(30, int(args.minutes * 60))
    result_file = RESULTS_DIR / f"{args.name}.json"
    out = RESULTS_DIR / f"{args.name}-locust"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="antumbra-soak-locust-") as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "model", TinyModelSpec())
        spec = {"path": str(model), "replicas": args.replicas, "max_ongoing_requests": 16,
                "max_model_len": 4096}
        config = {"stream_idle_timeout_s": 30, "models": {MODEL: spec}}
        with local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False,
                            redis_data_dir=Path(tmp) / "redis") as running:
            url, admin = running.base_url, {"Authorization": f"Bearer {running.admin_key}"}
            keys = {}
            for tenant in TENANTS:
                r = httpx.post(f"{url}/admin/tenants", json=tenant_spec(tenant), headers=admin, timeout=30)
                r.raise_for_status()
                keys[tenant] = r.json()["api_key"]
            loads = [{"name": t, "api_key": keys[t], **TENANTS[t]["load"]} for t in TENANTS]
            print(f"soak: Locust for {duration_s} s, {args.users} users, redis-server killed {args.kills}x",
                  flush=True)
            started = time.monotonic()
            locust = start_locust(url, loads, out, duration_s=duration_s, users=args.users)
            kills: list[dict[str, Any]] = []
            for k in range(args.kills):
                at = started + duration_s * (k + 1) / (args.kills + 1)
                time.sleep(max(0.0, at - time.monotonic()))
                kill = {"at_s": round(time.monotonic() - started, 1),
                        **kill_and_wait(running.local_redis, url, keys, k)}
                kills.append(kill)
                print(f"  kill {k + 1}: {kill}", flush=True)
            locust_rc = locust.wait()
            final = {"at_s": round(time.monotonic() - started, 1), "back_s": None,
                     "probes": {t: probe(url, key, "at the end") for t, key in keys.items()}}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the usage still queued in the ingress is written
                if not httpx.get(f"{url}/health", timeout=10).json()["usage_pending"]:
                    break
                time.sleep(0.5)
            health = httpx.get(f"{url}/health", timeout=10).json()
            summary, report = locust_results(out)
            usage = compare(client_totals(report, [*kills, final]), platform_totals(url, admin))
            restarts = running.redis_supervisor.restarts
    served = all(p["status"] == 200 for k in [*kills, final] for p in k["probes"].values())
    checks = {
        "redis_back_within_5s": all(k["back_s"] is not None and k["back_s"] <= BACK_BOUND_S for k in kills),
        "every_tenant_served_after_each_kill": served,
        "usage_lost_tokens": sum(sum(u["lost"].values()) for u in usage.values()),
        "usage_doubled_tokens": sum(sum(u["doubled"].values()) for u in usage.values()),
        "locust_failures": summary.get("failures"),
    }
    result = {
        **provenance("cpu"), "benchmark": "soak_locust_cpu", "minutes": args.minutes, "users": args.users,
        "tenants": {t: {"load": v["load"], "spec": tenant_spec(t)} for t, v in TENANTS.items()},
        "locust_exit_code": locust_rc, "locust_dir": str(out.relative_to(REPO)), "locust": summary,
        "kills": kills, "final_probes": final["probes"], "supervisor_restarts": restarts,
        "health_after": health, "usage": usage, "checks": checks,
        "all_checks_ok": checks["redis_back_within_5s"] and served and checks["usage_lost_tokens"] == 0
        and checks["usage_doubled_tokens"] == 0 and checks["locust_failures"] == 0,
    }
    result_file.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"checks": checks, "all_checks_ok": result["all_checks_ok"]}, indent=2), "->",
          result_file)


if __name__ == "__main__":
    main()
