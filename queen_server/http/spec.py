"""The OpenAPI spec as the routes really behave: bodies the hot routes parse themselves, and
the errors each group of routes answers, all in OpenAI's ``ErrorResponse`` shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from queen_server.http.io import request_schema
from shared_schema import ErrorResponse


def publish_request_schemas(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> None:
    """Routes parse their own bodies; put those bodies' schemas into the OpenAPI spec."""

    bodies = tuple(bodies)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in bodies:
                schema = request_schema(model, ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            _document_errors(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# The errors each group of routes can answer, besides its own (see errors.py). Bad input is a
# 400 in OpenAI's shape (error_handlers.py's validation handler), never FastAPI's 422.
ROUTE_ERRORS: tuple[tuple[str, dict[str, str]], ...] = (
    ("/v1/", {"401": "Missing or wrong API key (when keys are required)",
              "402": "The key's balance or spend budget is too low",
              "429": "The key's rate or concurrency limit"}),
    ("/admin/", {"401": "Missing or wrong admin token",
                 "404": "The admin API is off (no APIARY_ADMIN_TOKEN), no database, or no such "
                        "key"}),
    ("/worker/earnings", {"401": "Missing, stale or wrong worker signature",
                          "404": "This queen keeps no ledger"}),
    ("/worker/stats", {"404": "No worker with this key has connected"}),
)


def _document_errors(spec: dict[str, Any]) -> None:
    """Put the errors the routes really answer into the spec, all as ``ErrorResponse``."""

    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}

    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("ErrorResponse", ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}"))
    components.update(components["ErrorResponse"].pop("$defs", {}))
    for path, operations in spec.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            takes_input = responses.pop("422", None) is not None or "requestBody" in operation
            if takes_input or operation.get("parameters"):
                responses.setdefault("400", error("Invalid request"))
            for prefix, statuses in ROUTE_ERRORS:
                if path.startswith(prefix):
                    for status, description in statuses.items():
                        responses.setdefault(status, error(description))
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
