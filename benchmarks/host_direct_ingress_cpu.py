"""The HTTP path's CPU per streamed chunk through Serve's proxy, and straight to the ingress replicas.

    python -m benchmarks.host_direct_ingress_cpu [--concurrency 32] [--tokens 256] [--rounds 2]

The platform serves the tiny checkpoint on this machine's CPU with Serve's direct ingress on
(`RAY_SERVE_ENABLE_DIRECT_INGRESS`): each ingress replica also serves HTTP itself on a port of its
own, and Serve's proxy stays in front of them as before. The same load (`--concurrency` streams of
`--tokens` tokens, 32-256-token prompts) then runs, alternating `--rounds` times, through the
proxy and straight to the ingress replicas (streams spread over their ports); then, on a platform
started in Serve's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY`: the HAProxy that Ray ships balances
the clients' connections over the ingress replicas, which serve HTTP themselves), through its
address. Each pass comes with the CPU time every process kind spent on it per streamed chunk
(`serving/process_cpu.py`): what each HTTP path costs the platform per token, the price every
token pays at the GPU's pace. The model's forward on the CPU sets the pace here, so inter-token
times are not the GPU's; the CPU per chunk of the hops is. Writes benchmarks/results/host-direct-ingress.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from .lib.records import RESULTS_DIR, provenance
from .serving.process_cpu import cpu_per_chunk, cpu_seconds
from .serving.stream_load import HAPROXY_ENV, Load, http_level

MODEL = "tiny"
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
VOCAB = 256  # prompt token ids drawn below this


def _replica_urls(app: str) -> list[str]:
    """The ingress replicas' own HTTP addresses, from Serve's controller (direct ingress only)."""
    import ray
    from ray import serve

    client = serve.context._get_global_client()
    assert client is not None, "Serve is not running"
    groups = client._controller.get_target_groups.remote(app)

    urls: list[str] = []
    for group in ray.get(groups, timeout=30):
        if str(getattr(group, "protocol", "")).upper().endswith("HTTP"):
            # The replicas listen where Serve's HTTP options say (this machine's loopback here).
            urls.extend(f"http://127.0.0.1:{t.port}" for t in group.targets)
    return sorted(set(urls))


async def _spread(urls: list[str], api_key: str | None, load: Load) -> dict[str, Any]:
    """The load with its streams split evenly over `urls` (one client per address), merged."""
    per_url = max(1, load.concurrency // len(urls))
    share = [Load(load.model, load.prompts[i::len(urls)], per_url, load.new_tokens) for i in range(len(urls))]
    parts = await asyncio.gather(*(http_level(u, api_key, s) for u, s in zip(urls, share, strict=True)))
    wall = max(p["wall_s"] for p in parts)
    tokens = sum(p["output_tokens"] for p in parts)
    return {"requests": sum(p["requests"] for p in parts), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "itl_p50_s_by_replica": [p["itl_p50_s"] for p in parts],
            "itl_p99_s_by_replica": [p["itl_p99_s"] for p in parts]}


def _prompts(count: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(32, 257))] for _ in range(count)]


def measure(concurrency: int, tokens: int, rounds: int, ingress_replicas: int) -> dict[str, Any]:
    from antumbra.platform.launch.app import INGRESS_DEPLOYMENT, model_deployment_name
    from antumbra.platform.launch.redis_server import free_port
    from antumbra.platform.launch.serve_cli import APP_NAME, local_platform
    from antumbra.platform.launch.serve_env import serve_environment
    from antumbra.replicas.model.tiny import make_tiny_checkpoint

    deployments = (INGRESS_DEPLOYMENT, model_deployment_name(MODEL))
    out: dict[str, Any] = {"passes": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "tiny")
        config = {"ingress_replicas": ingress_replicas,
                  "models": {MODEL: {"path": str(model), "max_model_len": 1024, "max_ongoing_requests": 256}}}
        for environment, paths in ((DIRECT_INGRESS, ("proxy", "direct")), (HAPROXY_ENV, ("haproxy",))):
            with serve_environment(environment), \
                    local_platform(config, port=free_port(), num_cpus=2) as platform:
                urls = _replica_urls(APP_NAME) if "direct" in paths else []
                out.setdefault("ingress_urls", urls)
                for r in range(rounds):
                    for path in paths:
                        seed = 1000 * r + paths.index(path) + 10 * (environment is HAPROXY_ENV)
                        load = Load(MODEL, _prompts(2 * concurrency, seed, VOCAB), concurrency, tokens)
                        before = cpu_seconds(deployments)
                        if path == "direct":
                            stats = asyncio.run(_spread(urls, platform.api_key, load))
                        else:  # the platform's own address: Serve's proxy, or HAProxy in its mode
                            stats = asyncio.run(http_level(platform.base_url, platform.api_key, load))
                        after = cpu_seconds(deployments)
                        chunks = stats["output_tokens"]
                        stats["process_cpu"] = cpu_per_chunk(before, after, stats["wall_s"], chunks)
                        out["passes"].append({"path": path, "round": r, **stats})
                        print(path, r, {k: round(v["us_per_chunk"]) for k, v in stats["process_cpu"].items()},
                              round(stats["output_tokens_per_s"]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ingress-replicas", type=int, default=2)
    args = parser.parse_args()
    result = {**provenance("cpu"), "concurrency": args.concurrency, "tokens": args.tokens,
              **measure(args.concurrency, args.tokens, args.rounds, args.ingress_replicas)}
    out = RESULTS_DIR / "host-direct-ingress.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
