"""The models an ingress serves: each one's deployment handles, tokenizer and facts, and which one
a request names."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from antumbra.platform.ingress.capacity import RetryHint, Slots
from antumbra.platform.ingress.errors import REPLICA_GONE, model_not_ready
from antumbra.platform.ingress.openai_errors import ApiError, invalid
from antumbra.platform.ingress.tenant_spec import Tenant
from antumbra.replicas.model.tokenizer import Tokenizer


@dataclass
class ServedModel:
    name: str
    handle: Any  # DeploymentHandle
    stream_handle: Any  # the same, with stream=True
    tokenizer: Tokenizer
    thinking_default: bool = False  # chat answers think when a request does not say (and the encoding can)
    info: dict[str, Any] | None = None  # `ModelServer.get_model_info()`, asked once
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    slots: Slots = field(default_factory=Slots)  # generations in flight here, and the capacity gate
    retry_hint: RetryHint = field(default_factory=lambda: RetryHint(random.Random()))  # the gate's 503s

    @classmethod
    def of(cls, name: str, handle: Any, checkpoint_dir: str, thinking_default: bool = False) -> ServedModel:
        return cls(
            name=name,
            handle=handle,
            stream_handle=handle.options(stream=True),
            tokenizer=Tokenizer.from_dir(checkpoint_dir),
            thinking_default=thinking_default,
        )

    async def model_info(self, timeout_s: float) -> dict[str, Any]:
        """The model's context length and page size, asked of a replica once (503 while none answers)."""
        if self.info is None:
            async with self.lock:
                if self.info is None:
                    try:
                        async with asyncio.timeout(timeout_s):
                            self.info = await self.handle.get_model_info.remote()
                    except (TimeoutError, BackPressureError, DeploymentUnavailableError, *REPLICA_GONE):
                        raise model_not_ready(self.name) from None
        return self.info


def model_for(body: Any, tenant: Tenant, models: Mapping[str, ServedModel]) -> ServedModel:
    """The model a request body names: 400 without one, 404 if not served, 403 if not the tenant's."""
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise invalid("model: a model name is required", "model")
    model = models.get(name)
    if model is None:
        raise ApiError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
    if not tenant.allows_model(name):
        raise ApiError(
            403,
            f"this API key may not use the model `{name}`",
            type="permission_error",
            param="model",
            code="model_not_allowed",
        )
    return model
