"""The pages: ``/`` for developers, ``/admin/*`` for the operator, and the admin login.

Each page has one JSON source, a route that answers what a function of ``queen_server.reports``
builds (``/stats``, ``/admin/api/*``, ``/admin/keys``). The page calls that function itself and
renders its answer on the server, so the first paint needs no script; ``static/app.js`` then
polls the route and updates the bound elements, tables and charts in place. The template
declares the bindings (``data-field``, ``data-rows``, ``data-chart``); ``formatting.py`` and
``app.js`` format values the same way, kind by kind. The admin session is in ``session.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import jinja2
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from queen_server import __version__, reports
from queen_server.errors import ApiError
from queen_server.web.formatting import (
    JOB_COLUMNS,
    KEY_COLUMNS,
    MODEL_COLUMNS,
    PAYOUT_COLUMNS,
    PUBLIC_MODEL_COLUMNS,
    WORKER_COLUMNS,
    WORKER_JOB_COLUMNS,
    cell,
    field,
    fmt,
    lookup,
)
from queen_server.web.guard import retry_after_header
from queen_server.web.session import (
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    admin_authorized,
    admin_session_valid,
    admin_token,
    check_origin,
    client_address,
    login_limiter,
    login_redirect,
    read_form,
    safe_next,
    secure_cookie,
    session_cookie,
    settings,
    token_matches,
)

if TYPE_CHECKING:
    from queen_server.runtime import QueenState

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"
STATIC_PREFIX = "/static"

REFRESH_MS = 3000
LOAD_TIMEOUT_S = 5.0

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
       "form-action 'self'")

Report = Callable[["QueenState"], Awaitable[Any]]

router = APIRouter(include_in_schema=False)
router.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="web-static")


# --- rendering --------------------------------------------------------------------------------

def _static_versions() -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:10]
            for path in STATIC_DIR.iterdir() if path.is_file()}


_VERSIONS = _static_versions()


def static_url(name: str) -> str:
    version = _VERSIONS.get(name)
    return f"{STATIC_PREFIX}/{name}" + (f"?v={version}" if version else "")


_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)
_env.globals.update(static=static_url, cell=cell, field=field, lookup=lookup, fmt=fmt,
                    version=__version__, refresh_ms=REFRESH_MS)
templates = Jinja2Templates(env=_env)

NAV = (
    ("/admin", "Overview"),
    ("/admin/workers", "Workers"),
    ("/admin/models", "Models"),
    ("/admin/jobs", "Jobs"),
    ("/admin/api-keys", "Keys"),
    ("/admin/payouts", "Payouts"),
)


def _page(request: Request, template: str, status_code: int = 200, **context: Any) -> Response:
    context.setdefault("nav", NAV)
    context.setdefault("active", "")
    context.setdefault("source", None)
    context.setdefault("data", None)
    context.setdefault("load_error", None)
    context.setdefault("admin", False)
    response = templates.TemplateResponse(request, template, context, status_code=status_code)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    if context["admin"] or template == "login.html":
        response.headers["Cache-Control"] = "no-store"
    return response


async def load(request: Request, source: str, report: Report) -> tuple[int, Any]:
    """The page's data: what ``report`` answers, as the route at ``source`` sends it.

    Returns 200 and the data as JSON gives it back (so the first paint shows what the script
    will fetch), or the status of the report's ``ApiError`` and None, or 0 and None when the
    report failed or took over ``LOAD_TIMEOUT_S``.
    """
    try:
        async with asyncio.timeout(LOAD_TIMEOUT_S):
            data = await report(request.app.state.queen)
        return 200, orjson.loads(orjson.dumps(data))
    except ApiError as error:
        if error.status_code != 404:
            log.warning("page %s: %s answered %d", request.url.path, source, error.status_code)
        return error.status_code, None
    except Exception:
        log.exception("page %s: loading %s failed", request.url.path, source)
        return 0, None


def _load_error(status: int, source: str) -> str | None:
    if status == 200:
        return None
    if status == 0:
        return f"Could not load {source}; retrying."
    return f"{source} answered HTTP {status}; retrying."


async def _admin_page(request: Request, template: str, source: str, report: Report,
                      active: str, **context: Any) -> Response:
    if not admin_authorized(request):
        return login_redirect(request)
    status, data = await load(request, source, report)
    return _page(request, template, admin=True, source=source, data=data, active=active,
                 load_error=_load_error(status, source), **context)


# --- public pages -----------------------------------------------------------------------------

@router.get("/", response_class=HTMLResponse)
async def landing(request: Request) -> Response:
    status, data = await load(request, "/stats", reports.stats)
    # The examples name the first model on offer, or this placeholder while there is none.
    return _page(request, "landing.html", source="/stats", data=data,
                 load_error=_load_error(status, "/stats"), columns=PUBLIC_MODEL_COLUMNS,
                 api_base=str(request.base_url) + "v1", example_model="MODEL_NAME",
                 auth_open=settings(request).auth == "open")


# --- login ------------------------------------------------------------------------------------

@router.get("/admin/login", response_class=HTMLResponse)
async def login_form(request: Request) -> Response:
    target = safe_next(request.query_params.get("next"))
    if admin_token(request) and admin_session_valid(request):
        return RedirectResponse(target, status_code=303)
    return _page(request, "login.html", enabled=admin_token(request) is not None,
                 next=target, error=None)


@router.post("/admin/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    """Check the token and start a session. Wrong tokens are rate-limited per client address
    (429 with ``Retry-After``, the token not even checked then); a form posted from another
    site's page is refused (403), a request without ``Origin`` (a script) is not."""
    check_origin(request, required=False)
    token = admin_token(request)
    form = await read_form(request)
    if form is None:
        return _page(request, "login.html", 413, enabled=token is not None, next="/admin",
                     error="That form was too large.")
    target = safe_next(form.get("next"))
    if token is None:
        return _page(request, "login.html", 404, enabled=False, next=target, error=None)
    address = client_address(request)
    limiter = login_limiter(request)
    wait_s = limiter.retry_after(address)
    if wait_s is not None:
        log.info("admin login from %s refused for %.0f s more: too many wrong tokens",
                 address, wait_s)
        response = _page(request, "login.html", 429, enabled=True, next=target,
                         error="Too many wrong tokens: wait a minute, then try again.")
        response.headers["Retry-After"] = retry_after_header(wait_s)
        return response
    if not token_matches(form.get("token", ""), token):
        limiter.failed(address)
        log.warning("admin login refused from %s", address)
        return _page(request, "login.html", 401, enabled=True, next=target,
                     error="That is not the admin token.")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(SESSION_COOKIE, session_cookie(token), max_age=SESSION_MAX_AGE_S,
                        path="/", httponly=True, samesite="lax", secure=secure_cookie(request))
    return response


@router.post("/admin/logout")
async def logout(request: Request) -> Response:
    check_origin(request, required=False)
    response = RedirectResponse("/admin/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="lax",
                           secure=secure_cookie(request))
    return response


# --- admin pages ------------------------------------------------------------------------------

@router.get("/admin", response_class=HTMLResponse)
async def overview(request: Request) -> Response:
    return await _admin_page(request, "admin_overview.html", "/admin/api/overview",
                             reports.overview, "/admin")


@router.get("/admin/workers", response_class=HTMLResponse)
async def workers(request: Request) -> Response:
    return await _admin_page(request, "admin_workers.html", "/admin/api/workers",
                             reports.workers, "/admin/workers", columns=WORKER_COLUMNS)


@router.get("/admin/workers/{public_id}", response_class=HTMLResponse)
async def worker(request: Request, public_id: str) -> Response:
    if not admin_authorized(request):
        return login_redirect(request)
    source = "/admin/api/workers/" + quote(public_id, safe="")

    async def report(state: QueenState) -> Any:
        return await reports.worker(state, public_id)

    status, data = await load(request, source, report)
    if status == 404:
        return _page(request, "admin_worker.html", 404, admin=True, active="/admin/workers",
                     public_id=public_id, data=None, columns=WORKER_JOB_COLUMNS,
                     load_error=None, missing=True)
    return _page(request, "admin_worker.html", admin=True, active="/admin/workers",
                 source=source, data=data, public_id=public_id, columns=WORKER_JOB_COLUMNS,
                 load_error=_load_error(status, source), missing=False)


@router.get("/admin/models", response_class=HTMLResponse)
async def models(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/models", reports.models,
                             "/admin/models", columns=MODEL_COLUMNS, title="Models",
                             row_key="id",
                             intro="Every model a connected worker holds, and its price.",
                             empty="No connected worker holds a model.")


@router.get("/admin/jobs", response_class=HTMLResponse)
async def jobs(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/jobs", reports.jobs,
                             "/admin/jobs", columns=JOB_COLUMNS, title="Recent jobs",
                             row_key="id", intro="The latest jobs, newest first.",
                             empty="No jobs yet.")


@router.get("/admin/api-keys", response_class=HTMLResponse)
async def keys(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/keys", reports.api_keys,
                             "/admin/api-keys", columns=KEY_COLUMNS, title="API keys",
                             row_key="id",
                             intro="Developers' keys and their balances. Make and credit keys "
                                   "with apiary-queen keys, or POST /admin/keys.",
                             empty="No keys yet.")


@router.get("/admin/payouts", response_class=HTMLResponse)
async def payouts(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/payouts",
                             reports.payouts, "/admin/payouts", columns=PAYOUT_COLUMNS,
                             title="Payouts", row_key="id",
                             intro="Payouts to workers, newest first.",
                             empty="No payouts yet.")
