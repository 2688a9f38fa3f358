"""The admin API's bodies and errors: tenants as JSON, tenant-store failures as OpenAI-shaped errors."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from antumbra.platform.ingress.errors import REDIS_ERRORS
from antumbra.platform.ingress.openai_errors import ApiError
from antumbra.platform.ingress.tenant_spec import (
    ApiKeyConflict,
    Tenant,
    TenantError,
    TenantExists,
    TenantNotFound,
)

MAX_REPLICAS = 1024  # bounds a round of replicas (each answers once, then repeats)
M = TypeVar("M")


class WeightsBody(BaseModel):
    """`POST /admin/models/{name}/weights`: a checkpoint directory every replica can read, and the
    version its outputs will carry."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    version: str = Field(min_length=1, max_length=128)


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return tenant.to_spec().model_dump()


@contextlib.asynccontextmanager
async def admin_errors(store: str = "the tenant store") -> AsyncIterator[None]:
    """404 for an unknown tenant, 409 for a taken id or key, 503 when `store` (Redis) fails."""
    try:
        yield
    except TenantNotFound as exc:
        raise ApiError(404, str(exc), param="tenant_id", code="tenant_not_found") from None
    except (TenantExists, ApiKeyConflict) as exc:
        raise ApiError(409, str(exc), code="conflict") from None
    except (TenantError, *REDIS_ERRORS) as exc:
        raise ApiError(503, f"{store} is unavailable: {exc}", type="server_error") from None


def served_or_404(models: Mapping[str, M], model: str) -> M:
    """The served model named in an admin path, or a 404."""
    served = models.get(model)
    if served is None:
        raise ApiError(404, f"the model `{model}` does not exist", param="model", code="model_not_found")
    return served


Answer = dict[str, Any]


async def each_replica(ask: Callable[[frozenset[str]], Awaitable[Answer]]) -> dict[str, Answer]:
    """Every live replica's answer, by replica id: `ask(answered)` again and again (the router sends
    it to a replica not in `answered` while one is left) until a replica answers twice."""
    answers: dict[str, Answer] = {}
    for _ in range(MAX_REPLICAS):
        answer = await ask(frozenset(answers))
        if answer["replica_id"] in answers:
            break
        answers[answer["replica_id"]] = answer
    return answers
