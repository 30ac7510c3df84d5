"""The admin session: a cookie signed with itsdangerous under a secret derived from the admin
token, so changing ``APIARY_ADMIN_TOKEN`` ends every session. It holds no state on the server:
logging out deletes the cookie, and the cookie itself expires after ``SESSION_MAX_AGE_S``.

``admin_authorized`` is the check every admin page makes (the session, or the bearer token);
``create_app`` hands ``admin_session_valid`` to the admin JSON routes, which check the bearer
token themselves, so that the pages' session opens the JSON the pages poll. A state-changing
request (a POST) that only the cookie authenticates must also come from this queen's own page
(its ``Origin``, or ``Referer``): ``admin_session_valid`` raises ``Forbidden`` (403) when not.
The pages' forms also carry a per-session token (``csrf_token``) that the handler checks.
The login's rate limit and the cookie's ``Secure`` flag are decided in ``guard.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlencode

from fastapi import Request
from fastapi.responses import RedirectResponse
from itsdangerous import BadSignature, URLSafeTimedSerializer

from queen_server.errors import Forbidden
from queen_server.web.guard import (
    LoginLimiter,
    changes_state,
    claimed_origin,
    cookie_secure,
    same_origin,
)

if TYPE_CHECKING:
    from queen_server.settings import QueenSettings

log = logging.getLogger(__name__)

SESSION_COOKIE = "apiary_admin"
SESSION_MAX_AGE_S = 12 * 3600
MAX_FORM_BYTES = 16 * 1024


def settings(request: Request) -> QueenSettings:
    return request.app.state.queen.settings


def admin_token(request: Request) -> str | None:
    """The admin token, or None when the admin pages are off."""
    return settings(request).admin_token or None


def serializer(token: str) -> URLSafeTimedSerializer:
    secret = hmac.new(token.encode(), b"apiary admin session cookie", hashlib.sha256).digest()
    return URLSafeTimedSerializer(secret, salt="apiary-admin-session")


def session_cookie(token: str) -> str:
    """A new session's cookie value (a nonce, so no two sessions share a value)."""
    return serializer(token).dumps({"admin": True, "n": secrets.token_hex(8)})


def _session(request: Request) -> dict[str, object] | None:
    """The request's unexpired admin session for the current token, or None."""
    token = admin_token(request)
    raw = request.cookies.get(SESSION_COOKIE)
    if not token or not raw:
        return None
    try:
        data = serializer(token).loads(raw, max_age=SESSION_MAX_AGE_S)
    except BadSignature:  # includes SignatureExpired
        return None
    return data if isinstance(data, dict) and data.get("admin") is True else None


def _cookie_valid(request: Request) -> bool:
    return _session(request) is not None


def csrf_token(request: Request) -> str | None:
    """The form token of this request's admin session, or None without a session.

    Session-bound, and kept nowhere: an HMAC (under a secret derived from the admin token) of
    the session cookie's own nonce, so each login gets its own token and a new admin token
    voids them all. A page of another site can neither read it (the same-origin policy) nor
    compute it (the cookie is HttpOnly and the secret never leaves the queen), so a form it
    posts with the operator's cookie fails this check even where the ``Origin`` check would
    not catch it (a sibling subdomain, a browser that leaves ``Origin`` out).
    """
    token = admin_token(request)
    data = _session(request)
    if not token or data is None:
        return None
    secret = hmac.new(token.encode(), b"apiary admin form token", hashlib.sha256).digest()
    return hmac.new(secret, str(data.get("n", "")).encode(), hashlib.sha256).hexdigest()


def csrf_valid(request: Request, given: str | None) -> bool:
    """Whether a posted form token is this request's session's (compared in constant time)."""
    expected = csrf_token(request)
    return bool(expected and given) and hmac.compare_digest(expected.encode(),
                                                            str(given).encode())


def admin_session_valid(request: Request) -> bool:
    """Whether the request carries an unexpired admin session cookie for the current token.

    Raises ``Forbidden`` for a state-changing request whose cookie is valid but whose
    ``Origin`` (or ``Referer``) is missing or another site's: the browser sent the cookie on
    a page of someone else's making."""
    if not _cookie_valid(request):
        return False
    if changes_state(request.method):
        check_origin(request, required=True)
    return True


def check_origin(request: Request, *, required: bool) -> None:
    """Raise ``Forbidden`` unless the request's ``Origin`` (or ``Referer``) is this queen's own
    origin; a request naming neither passes only when not ``required``."""
    claimed = claimed_origin(request.headers.get("origin"), request.headers.get("referer"))
    if same_origin(claimed, str(request.base_url), required=required):
        return
    log.warning("refused a cross-origin %s %s from %s (origin %r)", request.method,
                request.url.path, client_address(request), claimed)
    raise Forbidden("This admin request did not come from this queen's own pages (its Origin "
                    "is missing or another site's); scripts should send the bearer token.",
                    code="cross_origin_request")


def client_address(request: Request) -> str:
    """The client's address (uvicorn puts a trusted proxy's ``X-Forwarded-For`` here)."""
    return request.client.host if request.client else "unknown"


def login_limiter(request: Request) -> LoginLimiter:
    """This app's limiter on wrong admin tokens, made on first use from its settings."""
    limiter = getattr(request.app.state, "admin_login_limiter", None)
    if limiter is None:
        config = settings(request)
        limiter = LoginLimiter(config.admin_login_failures_per_minute,
                               config.admin_login_global_failures_per_minute)
        request.app.state.admin_login_limiter = limiter
    return limiter


def secure_cookie(request: Request) -> bool:
    """Whether this request's session cookie gets ``Secure`` (``APIARY_ADMIN_COOKIE_SECURE``)."""
    return cookie_secure(settings(request).admin_cookie_secure, request.url.scheme)


def _bearer_valid(request: Request, token: str) -> bool:
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def admin_authorized(request: Request) -> bool:
    """The admin check for the pages: a session cookie or the bearer token.

    False whenever no admin token is set (the admin pages and API are off then).
    """
    token = admin_token(request)
    if not token:
        return False
    return _bearer_valid(request, token) or admin_session_valid(request)


def token_matches(given: str, token: str) -> bool:
    """Whether a login form's token is the admin token (compared in constant time)."""
    given = given.strip()
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def safe_next(value: str | None) -> str:
    """Where to go after logging in: an admin page of this queen, never another site."""
    if (not value or not value.startswith("/admin") or value.startswith("/admin/login")
            or "//" in value or "\\" in value or any(ord(c) < 0x20 for c in value)):
        return "/admin"
    return value


def login_redirect(request: Request) -> RedirectResponse:
    """To the login page, which comes back to this page after."""
    target = request.url.path
    if request.url.query:
        target += "?" + request.url.query
    return RedirectResponse("/admin/login?" + urlencode({"next": target}), status_code=303)


async def read_form(request: Request) -> dict[str, str] | None:
    """A small urlencoded form's first value per field; None when over ``MAX_FORM_BYTES``."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in parsed.items()}
