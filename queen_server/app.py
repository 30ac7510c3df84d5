"""``create_app(settings)``: the queen as a FastAPI application, with all state on ``app.state``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from queen_server import __version__, web
from queen_server.admin_api import router as admin_router
from queen_server.api import SCHEMAS, chat_completions, embeddings, json_response, router
from queen_server.billing.service import Billing
from queen_server.db import Database
from queen_server.dispatch import Dispatcher
from queen_server.earnings import router as earnings_router
from queen_server.errors import ApiError, InvalidRequest, NotFound
from queen_server.http_io import param_name, request_schema
from queen_server.payouts import PayoutRunner, make_backend
from queen_server.registry import Registry
from queen_server.settings import QueenSettings
from queen_server.stats.metrics import Metrics
from queen_server.stats.store import StatsStore
from queen_server.stats.swarm import SwarmStats
from queen_server.stats_api import router as stats_router
from queen_server.worker_ws import worker_endpoint
from shared_schema import ErrorResponse
from shared_schema.protocol import CLOSE_GOING_AWAY

log = logging.getLogger(__name__)


@dataclass
class QueenState:
    settings: QueenSettings
    registry: Registry
    dispatcher: Dispatcher
    billing: Billing
    db: Database | None
    stats: SwarmStats
    metrics: Metrics


Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> Response:
    response = json_response(error.body().model_dump(), error.status_code)
    response.headers.update(error.headers)
    return response


class QueenApp(FastAPI):
    """FastAPI, with the hot OpenAI routes dispatched straight from the ASGI entry point.

    FastAPI's middleware, router and dependency solving cost about 150 us a request (see
    bench/RESULTS.md); these handlers read, check and answer requests by themselves, so they skip
    that layer. They stay registered as ordinary routes too, for the OpenAPI spec and docs.
    """

    hot_routes: dict[tuple[str, str], Handler]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        handler = self.hot_routes.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                await super().__call__(scope, receive, observed_send)
            else:
                scope["app"] = self
                try:
                    response = await handler(Request(scope, receive))
                except ApiError as exc:
                    response = self.error_response(exc)
                except Exception:
                    log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                    response = self.error_response(ApiError("The queen hit an internal error."))
                await response(scope, receive, observed_send)
        finally:
            route = scope.get("route")
            path = scope["path"] if handler is not None else getattr(route, "path", "other")
            self.state.queen.metrics.observe_http(path, scope["method"], status,
                                                  time.perf_counter() - started)

    def error_response(self, error: ApiError) -> Response:
        self.state.queen.metrics.errors.labels(error.code or "error").inc()
        return error_response(error)


def create_app(settings: QueenSettings | None = None, *, use_db: bool = True) -> FastAPI:
    settings = settings or QueenSettings()
    registry = Registry()
    db = Database(settings.db) if use_db else None
    billing = Billing(settings, db)
    stats = SwarmStats()
    metrics = Metrics(workers=lambda: len(registry), queued=lambda: registry.waiting)

    def size_class_of(model: str) -> str:
        return billing.prices.for_parameters(registry.parameter_count(model)).size_class

    state = QueenState(
        settings=settings,
        registry=registry,
        dispatcher=Dispatcher(registry, settings, stats, size_class_of, metrics),
        billing=billing,
        db=db,
        stats=stats,
        metrics=metrics,
    )
    stats_store = StatsStore(db.engine, stats) if db is not None else None

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if state.db is not None:
            await state.db.start()
        if stats_store is not None:
            await stats_store.load()
            stats_store.start()
        await state.billing.start()
        http = httpx.AsyncClient(timeout=20, trust_env=False)
        payouts = None
        if state.db is not None and state.billing.ledger is not None:
            payouts = PayoutRunner(settings, state.db.engine, state.billing.ledger,
                                   make_backend(settings, http), http)
            payouts.start()
            log.info("payouts: %s backend, every %.0f s, threshold %d sats",
                     settings.lightning_backend, settings.payout_interval_s,
                     settings.payout_threshold_sats)
        try:
            yield
        finally:
            await registry.close_all(CLOSE_GOING_AWAY, "the queen is shutting down")
            if payouts is not None:
                await payouts.stop()
            await http.aclose()
            await state.billing.stop()
            if stats_store is not None:
                await stats_store.stop()
            if state.db is not None:
                await state.db.close()

    app = QueenApp(
        title="Apiary queen",
        version=__version__,
        description="An OpenAI-compatible API served by a swarm of volunteer GPUs.",
        lifespan=lifespan,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.queen = state
    app.hot_routes = {("POST", "/v1/chat/completions"): chat_completions,
                      ("POST", "/v1/embeddings"): embeddings}
    app.include_router(router)
    app.include_router(earnings_router)
    app.include_router(admin_router)
    app.include_router(stats_router)
    app.include_router(web.router)
    app.state.admin_session = web.admin_session_valid
    app.add_api_websocket_route("/worker", worker_endpoint)
    _install_error_handlers(app)
    _publish_request_schemas(app)
    return app


def _install_error_handlers(app: QueenApp) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return app.error_response(exc)

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
            headers = dict(exc.headers or {})
            if exc.status_code == 405:  # every method of the path, not only the first route's
                headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
            error = ApiError(str(exc.detail), code=f"http_{exc.status_code}", headers=headers)
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


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route serves at this path (FastAPI makes one route per method)."""
    return [method for method in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
            if any(route.matches({**scope, "method": method})[0] is Match.FULL
                   for route in app.routes)]


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
                schema = request_schema(model, ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            _document_errors(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# The errors each group of routes can answer, besides its own (see errors.py). Bad input is a
# 400 in OpenAI's shape (the validation handler above), never FastAPI's 422.
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
