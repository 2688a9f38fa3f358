"""A disaggregated model end to end: 1 prefill + 1 decode replica behind the ingress (real Ray Serve, a
real redis-server, the tiny model, the official openai client).

Same greedy tokens and logprobs as one in-process engine, streaming and not, in exact and release
numerics, and for a long prompt prefilled over two context-parallel ranks; the decode replica
counts the pages it adopted and the cached prefix pages it skipped; a prefill replica that dies
before the handoff is retried on its replacement; a decode replica killed mid-stream ends the stream
with an error event (last: Serve replaces it, the module does not wait). Ray's object-store
transport is checked across processes here too, where Ray is up anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from antumbra import Engine, SamplingParams
from antumbra.platform.launch.redis_server import free_port
from antumbra.platform.launch.serve_cli import APP_NAME, RunningPlatform, local_platform
from tests.faults.injection import in_new_processes
from tests.platform.launch.test_app import sse_events

MODEL = "tiny-pd"
RELEASE = "tiny-pd-release"  # the same checkpoint in release numerics (FP8 KV codes cross the transport)
DIE_TOKEN = 128001  # a V4 placeholder: a prompt holding it kills the prefill replica once (injected fault)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 261, (n,), generator=g).tolist()


@dataclasses.dataclass
class PD:
    running: RunningPlatform
    key: str
    engines: dict[str, Engine]  # in-process references, by served model

    @property
    def engine(self) -> Engine:
        return self.engines[MODEL]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.running.base_url}/v1", api_key=self.key, max_retries=0, timeout=120
        )

    def call(self, deployment: str, method: str) -> Any:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
        return getattr(handle, method).remote().result(timeout_s=60)

    def decode_stats(self) -> dict[str, float]:
        return self.call(f"Model-{MODEL}", "engine_stats")

    def prefill_stats(self) -> dict[str, float]:
        return self.call(f"Model-{MODEL}-prefill", "engine_stats")

    def check_both(self) -> None:
        self.call(f"Model-{MODEL}", "check_engine_integrity")
        self.call(f"Model-{MODEL}-prefill", "check_engine_integrity")


def test_disaggregation_config_and_flags(tiny_checkpoint: Path) -> None:
    """No Ray: the spec reads the mapping, refuses bad counts, and the serve flags fill it in."""
    from antumbra.cli import build_parser
    from antumbra.platform.launch.app import DisaggregationSpec, PlatformConfig
    from antumbra.platform.launch.serve_cli import config_from_args

    config = PlatformConfig.from_dict(
        {
            "redis_url": "redis://127.0.0.1:1/0",
            "models": {
                "m": {
                    "path": str(tiny_checkpoint),
                    "disaggregation": {"prefill_replicas": 2, "decode_replicas": 3},
                }
            },
        }
    )
    assert config.models[0].disaggregation == DisaggregationSpec(prefill_replicas=2, decode_replicas=3)
    for bad in ({"prefill_replicas": 0}, {"decode": 1}):
        with pytest.raises(ValueError):
            PlatformConfig.from_dict(
                {
                    "redis_url": "redis://x:1/0",
                    "models": {"m": {"path": str(tiny_checkpoint), "disaggregation": bad}},
                }
            )
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_checkpoint), "--prefill-replicas", "2", "--decode-replicas", "1"]
    )
    spec = next(iter(config_from_args(args)["models"].values()))
    assert spec["disaggregation"] == {"prefill_replicas": 2, "decode_replicas": 1}


@pytest.fixture(scope="module")
def pd(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    marker = tmp_path_factory.mktemp("pd") / "prefill-died"
    config = {
        "models": {
            MODEL: {
                "path": str(tiny_checkpoint),
                "max_model_len": 4096,
                "num_virtual_tokens": 16384,
                "disaggregation": {
                    "prefill_replicas": 1,
                    "decode_replicas": 1,
                    "prefill_retry_s": 90,
                    "cp_ranks": 2,
                    "cp_threshold_tokens": 1000,
                },
            },
            RELEASE: {
                "path": str(tiny_checkpoint),
                "max_model_len": 1024,
                "num_virtual_tokens": 4096,
                "numerics": "release",
                "disaggregation": {"prefill_replicas": 1, "decode_replicas": 1},
            },
        },
        "stream_idle_timeout_s": 120,
    }
    # A prefill replica that computed a prompt holding DIE_TOKEN dies before the handoff, once.
    with in_new_processes(f"die={DIE_TOKEN}@{marker}") as started, \
            local_platform(config, port=free_port(), num_cpus=2, create_default_tenant=False) as running:
        started()
        r = httpx.post(
            f"{running.base_url}/admin/tenants",
            json={"id": "pd"},
            headers={"Authorization": f"Bearer {running.admin_key}"},
        )
        assert r.status_code == 201, r.text
        engines = {
            MODEL: Engine.from_pretrained(tiny_checkpoint),
            RELEASE: Engine.from_pretrained(tiny_checkpoint, numerics="release"),
        }
        yield PD(running, r.json()["api_key"], engines)


def reference(pd: PD, prompt: list[int], max_tokens: int, model: str = MODEL) -> tuple[str, list[float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    out = pd.engines[model].generate([prompt], params)[0]
    return out.text, [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def complete(
    pd: PD, prompt: list[int], max_tokens: int = 6, stream: bool = False, model: str = MODEL
) -> tuple[str, list[float]]:
    kwargs: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        choice = pd.client().completions.create(**kwargs).choices[0]
        return choice.text, list(choice.logprobs.token_logprobs)
    chunks = [c for c in pd.client().completions.create(**kwargs, stream=True) if c.choices]
    return "".join(c.choices[0].text for c in chunks), [
        x for c in chunks for x in c.choices[0].logprobs.token_logprobs
    ]


def assert_same(got: tuple[str, list[float]], want: tuple[str, list[float]]) -> None:
    assert got[0] == want[0]
    assert (
        len(got[1]) == len(want[1]) and max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-4
    )


def test_pd_answers_like_one_engine(pd: PD) -> None:
    prompt = tokens(300, seed=1)
    want = reference(pd, prompt, 6)
    assert_same(complete(pd, prompt), want)
    assert_same(complete(pd, prompt, stream=True), want)
    stats = pd.decode_stats()
    assert stats["kv_adopted_requests"] >= 2 and stats["kv_adopted_pages"] >= 3
    assert pd.prefill_stats()["kv_exported_requests"] >= 2
    pd.check_both()


def test_pd_in_release_numerics(pd: PD) -> None:
    prompt = tokens(260, seed=11)
    want = reference(pd, prompt, 5, RELEASE)
    assert_same(complete(pd, prompt, 5, model=RELEASE), want)
    assert_same(complete(pd, prompt, 5, stream=True, model=RELEASE), want)


def test_decode_skips_the_prefix_pages_it_caches(pd: PD) -> None:
    system = tokens(300, seed=2)
    complete(pd, system + tokens(20, seed=3), max_tokens=2)  # the decode replica caches 2 pages of it
    before = pd.decode_stats()
    prompt = system + tokens(100, seed=4)
    assert_same(complete(pd, prompt, max_tokens=4), reference(pd, prompt, 4))
    after = pd.decode_stats()
    assert after["kv_skipped_pages"] - before["kv_skipped_pages"] == 2
    assert after["kv_adopted_pages"] - before["kv_adopted_pages"] == 2  # pages 2 and 3 of 400 tokens
    assert after["num_held"] == 0
    pd.check_both()


def test_a_long_prompt_is_prefilled_context_parallel(pd: PD) -> None:
    before = pd.prefill_stats()["cp_prefills"]
    prompt = tokens(1100, seed=12)
    assert_same(complete(pd, prompt, max_tokens=3), reference(pd, prompt, 3))
    assert pd.prefill_stats()["cp_prefills"] == before + 1
    pd.check_both()


def test_ray_object_store_transport_across_processes(pd: PD) -> None:
    import ray

    from antumbra.replicas.kv_transfer.transport import RayObjectTransport, TransferFailed

    payload = pd.engine.disaggregation.prefill_export(tokens(200, seed=5),
                                                      SamplingParams(max_tokens=2, temperature=0.0))

    @ray.remote(num_cpus=0)
    def checksums(ticket: Any) -> list[int]:
        got = RayObjectTransport().receive(ticket)
        return [int(t.reshape(-1).view(torch.uint8).long().sum()) for t in got.tensors.values()]

    ticket = RayObjectTransport().send(payload)
    assert ticket.nbytes == payload.nbytes
    assert ray.get(checksums.remote(ticket)) == [
        int(t.reshape(-1).view(torch.uint8).long().sum()) for t in payload.tensors.values()
    ]

    @ray.remote(num_cpus=0)
    def never() -> None:
        import threading

        threading.Event().wait(30)  # never set: the object it returns never arrives in time

    with pytest.raises(TransferFailed, match="could not be fetched"):
        RayObjectTransport().receive(dataclasses.replace(ticket, where=never.remote()), timeout_s=1)


def test_prefill_death_before_handoff_is_retried(pd: PD) -> None:
    prompt = tokens(150, seed=6) + [DIE_TOKEN] + tokens(10, seed=7)
    assert_same(complete(pd, prompt, max_tokens=3), reference(pd, prompt, 3))
    stats = pd.decode_stats()
    assert stats["prefill_retries"] >= 1 and stats["num_held"] == 0
    pd.check_both()


def test_decode_death_mid_stream_ends_with_an_error_event(pd: PD) -> None:
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    named = next(a for a in actors if f"#Model-{MODEL}#" in a["name"])
    decode_actor = ray.get_actor(named["name"], namespace=named["namespace"])
    body = {
        "model": MODEL,
        "prompt": tokens(50, seed=8),
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{pd.running.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {pd.key}"},
        timeout=60,
    ) as response:
        events = sse_events(response.iter_lines())
        for _ in range(8):
            next(events)
        ray.kill(decode_actor, no_restart=True)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert "error" in rest[-2] and set(rest[-2]["error"]) == {"message", "type", "param", "code"}
