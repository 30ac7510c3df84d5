"""``create_app(settings)``: the queen as a FastAPI application, with all state on ``app.state``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from queen_server import __version__
from queen_server.api import SCHEMAS, json_response, router
from queen_server.db import Database
from queen_server.dispatch import Dispatcher
from queen_server.errors import ApiError, InvalidRequest, NotFound
from queen_server.http_io import Authenticator, param_name
from queen_server.registry import Registry
from queen_server.settings import QueenSettings
from queen_server.worker_ws import worker_endpoint
from shared_schema.protocol import CLOSE_GOING_AWAY

log = logging.getLogger(__name__)


@dataclass
class QueenState:
    settings: QueenSettings
    registry: Registry
    dispatcher: Dispatcher
    auth: Authenticator
    db: Database | None


def create_app(settings: QueenSettings | None = None, *, use_db: bool = True) -> FastAPI:
    settings = settings or QueenSettings()
    registry = Registry()
    state = QueenState(
        settings=settings,
        registry=registry,
        dispatcher=Dispatcher(registry, settings),
        auth=Authenticator(settings.api_keys),
        db=Database(settings.db) if use_db else None,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if state.db is not None:
            await state.db.start()
        if state.auth.open:
            log.warning("no API keys are configured: the API is open to anyone who can reach it")
        try:
            yield
        finally:
            await registry.close_all(CLOSE_GOING_AWAY, "the queen is shutting down")
            if state.db is not None:
                await state.db.close()

    app = FastAPI(
        title="Apiary queen",
        version=__version__,
        description="An OpenAI-compatible API served by a swarm of volunteer GPUs.",
        lifespan=lifespan,
    )
    app.state.queen = state
    app.include_router(router)
    app.add_api_websocket_route("/worker", worker_endpoint)
    _install_error_handlers(app)
    _publish_request_schemas(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        response = json_response(exc.body().model_dump(), exc.status_code)
        response.headers.update(exc.headers)
        return response

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = param_name(first.get("loc", ()))
        return await api_error(request, InvalidRequest(str(first.get("msg")), param=param))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            error: ApiError = NotFound(f"No route {request.method} {request.url.path}")
        else:
            error = ApiError(str(exc.detail), code=f"http_{exc.status_code}")
            error.status_code = exc.status_code
            error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return await api_error(request, error)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return await api_error(request, ApiError("The queen hit an internal error."))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _publish_request_schemas(app: FastAPI) -> None:
    """Routes parse their own bodies; put those bodies' schemas into the OpenAPI spec."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in SCHEMAS:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
