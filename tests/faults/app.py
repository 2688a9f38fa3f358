"""The fault suite's app (`conftest.fault_app` starts it): its models, tenants and what tests read of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from antumbra.platform.launch.redis_server import LocalRedis
from antumbra.platform.launch.serve_cli import APP_NAME, RunningPlatform

MODEL = "tiny"  # 2 replicas: the model every fault scenario loads
HOST_MODEL = "tiny-host"  # 1 replica with HiSparse: C4 rows on the host tier
MAX_MODEL_LEN = 4096
MAX_ONGOING = 8  # per replica: the engine batches this many
MAX_QUEUED = 8  # per ingress, waiting for a replica (a burst counts while it is being routed)
# A step holding a prompt with this token raises (injected by `injection.py`): V4's first placeholder
# token, which no text prompt here contains (text holds it only if it spells the token out).
FAULT_TOKEN = 128000
CAPPED_RPM = 6  # burst 6, then one request every 10 s
TENANTS: dict[str, dict[str, Any]] = {
    "alpha": {},
    "beta": {},
    "capped": {"rpm": CAPPED_RPM},  # the tenant that runs into its rate limit
    "victim": {},  # the isolation audit's two tenants
    "attacker": {},
}
HELD = ("request_vpages", "request_swa_pages", "locked_cache_pages", "hot_buffers")


@dataclass
class FaultApp:
    running: RunningPlatform
    redis: LocalRedis
    keys: dict[str, str]  # tenant id -> API key

    @property
    def url(self) -> str:
        return self.running.base_url

    @property
    def key_prefix(self) -> str:
        return str(self.running.config.key_prefix)

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.running.admin_key}"}

    def client(self, tenant: str, timeout: float = 60) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0,
                                  timeout=timeout)

    def replicas(self, model: str = MODEL, check_integrity: bool = False) -> list[dict[str, Any]]:
        """Every live replica's state, through the admin API (`GET /admin/models/{model}/replicas`)."""
        return list(self._replicas_answer(model, check_integrity)["data"])

    def gate(self, model: str = MODEL) -> dict[str, Any]:
        """The ingress's capacity gate for the model: {"capacity", "in_flight"}."""
        return dict(self._replicas_answer(model, False)["ingress"])

    def _replicas_answer(self, model: str, check_integrity: bool) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/admin/models/{model}/replicas", headers=self.admin(), timeout=30,
                      params={"check_integrity": str(check_integrity).lower()})
        assert r.status_code == 200, r.text
        return dict(r.json())

    def running_replicas(self, model: str = MODEL) -> dict[str, int]:
        """Replica states of the model's deployment as Serve reports them, e.g. {"RUNNING": 2}."""
        from ray import serve

        from antumbra.platform.launch.app import model_deployment_name

        app = serve.status().applications[APP_NAME]
        states = app.deployments[model_deployment_name(model)].replica_states
        return {str(getattr(k, "value", k)): v for k, v in states.items() if v}

    def directory_matches(self, tenant: str, prompt: str, model: str = MODEL) -> tuple[dict[str, int], int]:
        """The router's directory lookup of `prompt` sent by `tenant` (completion, not chat): leading
        blocks per live replica, and how many full blocks the prompt has."""
        import redis.asyncio as aioredis

        from antumbra.cachestore.block_hash import block_hashes
        from antumbra.config import ModelConfig
        from antumbra.platform.ingress.tenants import TenantStore
        from antumbra.platform.routing.directory import PrefixDirectory
        from antumbra.replicas.model.checkpoint_files import load_hf_config
        from antumbra.replicas.model.tokenizer import Tokenizer

        path = next(m.path for m in self.running.config.models if m.name == model)
        page_size = ModelConfig.from_hf(load_hf_config(path)).page_size
        token_ids = Tokenizer.from_dir(path).encode(prompt)
        live = {s["replica_id"] for s in self.replicas(model)}

        async def lookup() -> tuple[dict[str, int] | None, int]:
            client = aioredis.Redis.from_url(self.redis.url)
            try:
                namespace = (await TenantStore(client, self.key_prefix).get(tenant)).cache_namespace
                hashes = block_hashes(token_ids, page_size, f"{model}:{namespace}")
                directory = PrefixDirectory(client, model, prefix=self.key_prefix, op_timeout_s=2.0)
                return await directory.lookup(hashes, live), len(hashes)
            finally:
                await client.aclose()

        matched, blocks = asyncio.run(lookup())
        assert matched is not None, "the prefix directory did not answer"
        return matched, blocks

    def settled(self, model: str = MODEL) -> bool:
        """No request in any engine of the model, nothing held beyond the cache."""
        return all(idle(state["stats"]) for state in self.replicas(model))


def idle(stats: dict[str, float]) -> bool:
    return stats["num_running"] + stats["num_waiting"] + stats["in_flight"] == 0 and all(
        stats[k] == 0 for k in HELD
    )


