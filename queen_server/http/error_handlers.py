"""Every HTTP error in OpenAI's shape, rendered in one place.

``render_error`` turns an ``ApiError`` into its response; the fast path calls it for the hot
routes, and the handlers installed here call it for FastAPI's own errors (validation, 404, 405)
and anything unexpected. Bad input is a 400 in OpenAI's shape, never FastAPI's 422.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from queen_server.errors import ApiError, InvalidRequest, NotFound
from queen_server.http.deps import json_response
from queen_server.http.io import param_name

log = logging.getLogger(__name__)


def error_response(error: ApiError) -> Response:
    response = json_response(error.payload(), error.status_code)
    response.headers.update(error.headers)
    return response


def install_error_handlers(app: FastAPI, render_error: Callable[[ApiError], Response]) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return render_error(exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = param_name(first.get("loc", ()))
        return render_error(InvalidRequest(str(first.get("msg")), param=param))

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
        return render_error(error)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render_error(ApiError("The queen hit an internal error."))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route serves at this path (FastAPI makes one route per method)."""
    return [method for method in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
            if any(route.matches({**scope, "method": method})[0] is Match.FULL
                   for route in app.routes)]
