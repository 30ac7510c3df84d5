"""What every HTTP route shares: the queen's state, JSON answers, and the admin check."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from queen_server.errors import NotFound, Unauthorized

if TYPE_CHECKING:
    from queen_server.runtime import QueenState


def queen(request: Request) -> QueenState:
    """The queen's shared state (``create_app`` puts it on ``app.state.queen``)."""
    return request.app.state.queen


def json_response(data: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


def require_admin(request: Request) -> QueenState:
    """The state, for a request with the admin token (a bearer header or a pages session).

    The session is the pages' (``web/session.py``); ``create_app`` hands its check over on
    ``app.state.admin_session``, since ``http`` and ``web`` must not import each other. The
    bearer token is checked first, so a script is never subject to the session's rules: the
    session check raises ``Forbidden`` (403) for a state-changing request whose cookie came
    with another site's ``Origin`` (or none)."""
    state = queen(request)
    token = state.settings.admin_token
    if not token:
        raise NotFound("The admin pages are off: set APIARY_ADMIN_TOKEN to turn them on.")
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return state
    session_check = getattr(request.app.state, "admin_session", None)
    if session_check is not None and session_check(request):
        return state
    raise Unauthorized("Log in at /admin/login, or send 'Authorization: Bearer <admin token>'.",
                       code="invalid_admin_token")
