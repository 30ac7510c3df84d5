"""The OpenAPI spec as the routes really behave: bodies the hot routes parse themselves, and
the errors each group of routes answers, all in OpenAI's ``ErrorResponse`` shape; and ``/docs``,
Swagger UI served from this queen alone.

FastAPI's own ``/docs`` loads Swagger UI's script and style from a CDN, so on a queen with no
internet (a LAN party, an air-gapped lab) the page is blank. ``install_docs`` serves the copy
of swagger-ui-dist that the ``fastapi-swagger`` package ships (in the ``queen`` extra) under
``/docs/assets``, the way FastAPI documents for self-hosted assets (``docs_url=None``, then
``get_swagger_ui_html`` with local URLs). ReDoc has no such package and is turned off.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from shared_schema import ErrorResponse

log = logging.getLogger(__name__)

DOCS_URL = "/docs"
DOCS_ASSETS = "/docs/assets"
SWAGGER_PACKAGE = ("fastapi_swagger", "resources")  # swagger-ui-bundle.js, swagger-ui.css
FAVICON_URL = "/favicon.ico"  # served by the pages (web/pages.py)


def install_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from this queen's own files, so it works with no internet.

    The app must be made with ``docs_url=None`` (and ``redoc_url=None``). Without the
    ``fastapi-swagger`` package (an install that skipped the ``queen`` extra), the page falls
    back to FastAPI's CDN copy, with a warning in the log.
    """
    package = SWAGGER_PACKAGE[0]
    local = importlib.util.find_spec(package) is not None
    if local:
        app.mount(DOCS_ASSETS, StaticFiles(packages=[SWAGGER_PACKAGE]), name="docs-assets")
    else:
        log.warning("%s is not installed: /docs loads Swagger UI from a CDN (pip install "
                    "'apiary[queen]' to serve it from this queen)", package.replace("_", "-"))

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        assets = {"swagger_js_url": f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                  "swagger_css_url": f"{root}{DOCS_ASSETS}/swagger-ui.css"} if local else {}
        return get_swagger_ui_html(openapi_url=root + (app.openapi_url or "/openapi.json"),
                                   title=f"{app.title} · API docs",
                                   swagger_favicon_url=root + FAVICON_URL, **assets)


def publish_request_schemas(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> None:
    """Routes parse their own bodies; put those bodies' schemas into the OpenAPI spec, as
    strict as the parsing (an OpenAI body's unknown field is refused, so its schema says
    ``additionalProperties: false``)."""

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
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
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
