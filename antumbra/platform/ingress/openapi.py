"""The OpenAPI document of the ingress, including the JSON bodies its handlers parse themselves.

The handlers read bodies themselves (to check size, auth and model before validation), so
FastAPI cannot see them; `json_body` documents each route's body and `openapi_schema` adds the
body models to the schema's components.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from antumbra.platform.ingress.openai_errors import ErrorResponse

# What every route may answer with besides its success.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 413, 429, 503)
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON body that the handler parses itself (to order the checks)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schema(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """FastAPI's schema of `app` plus the request `bodies` the handlers parse themselves (built once)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in bodies:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    app.openapi_schema = schema
    return schema
