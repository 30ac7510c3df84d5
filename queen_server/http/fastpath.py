"""The fast path: the two billed OpenAI routes served without FastAPI's router and dependency
layer, which cost about 150 us a request (see bench/RESULTS.md).

Each hot route is declared once, with ``HotRoutes.post``: that registers it on an ordinary
``APIRouter`` (for the OpenAPI spec and the docs) and in the table ``FastPath`` dispatches from.
``FastPath`` is an ASGI middleware that ``create_app`` installs as the innermost user middleware,
so any middleware added later wraps the hot routes too: none is ever skipped. Hot handlers read,
check and answer requests themselves; their ``ApiError`` goes through the same renderer as every
other route's (``error_handlers.render_error``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queen_server.errors import ApiError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
RouteKey = tuple[str, str]


class HotRoutes:
    """The hot routes: each one in the docs' router and in the fast path's table."""

    def __init__(self) -> None:
        self.router = APIRouter()
        self.handlers: dict[RouteKey, Handler] = {}

    def post(self, path: str, **route: Any) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.router.post(path, **route)(handler)
            self.handlers[("POST", path)] = handler
            return handler

        return register


class FastPath:
    """ASGI middleware: hot routes straight to their handler, the rest to the app inside.

    It also times every HTTP request for the metrics (``observe(path, method, status, s)``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        handlers: dict[RouteKey, Handler],
        render_error: Callable[[ApiError], Response],
        observe: Callable[[str, str, int, float], None],
    ) -> None:
        self.app = app
        self.handlers = handlers
        self.render_error = render_error
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        handler = self.handlers.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                await self.app(scope, receive, observed_send)
            else:
                try:
                    response = await handler(Request(scope, receive))
                except ApiError as exc:
                    response = self.render_error(exc)
                except Exception:
                    log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                    response = self.render_error(ApiError("The queen hit an internal error."))
                await response(scope, receive, observed_send)
        finally:
            route = scope.get("route")
            path = scope["path"] if handler is not None else getattr(route, "path", "other")
            self.observe(path, scope["method"], status, time.perf_counter() - started)
