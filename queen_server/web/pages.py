"""The pages: ``/`` for developers, ``/admin/*`` for the operator, and the admin login.

Each page has one JSON source, a route that answers what a function of ``queen_server.reports``
builds (``/stats``, ``/admin/api/*``, ``/admin/keys``). The page calls that function itself and
renders its answer on the server, so the first paint needs no script; ``static/app.js`` then
polls the route and updates the bound elements, tables and charts in place. The template
declares the bindings (``data-field``, ``data-rows``, ``data-chart``); ``formatting.py`` and
``app.js`` format values the same way, kind by kind. The admin session is in ``session.py``.

Two pages do more than show: the landing page tells a would-be worker what to download and the
URL to paste (``joining.py``), and the Keys page makes, credits and revokes keys through the
same functions as the CLI (``billing.admin``), its forms read by ``key_forms.py`` and guarded by
the session's ``Origin`` check and a per-session form token (``session.csrf_token``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import jinja2
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from queen_server import __version__, reports
from queen_server.billing.admin import create_key, credit_key, revoke_key
from queen_server.errors import ApiError
from queen_server.web.formatting import (
    AUDIT_COLUMNS,
    GROUP_COLUMNS,
    JOB_COLUMNS,
    KEY_COLUMNS,
    MODEL_COLUMNS,
    PAYOUT_COLUMNS,
    PLACEMENT_COLUMNS,
    PUBLIC_MODEL_COLUMNS,
    UNGROUPED_COLUMNS,
    WORKER_COLUMNS,
    WORKER_JOB_COLUMNS,
    cell,
    field,
    fmt,
    lookup,
)
from queen_server.web.guard import retry_after_header
from queen_server.web.joining import VARIANTS, pay_sentence, worker_url
from queen_server.web.key_forms import CreateKey, CreditKey, FormError, KeyAction, parse_key_form
from queen_server.web.session import (
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    admin_authorized,
    admin_session_valid,
    admin_token,
    check_origin,
    client_address,
    csrf_token,
    csrf_valid,
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
    from queen_server.billing.keys import KeyStore
    from queen_server.billing.store import LedgerStore
    from queen_server.runtime import QueenState

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"
STATIC_PREFIX = "/static"
FAVICON = STATIC_DIR / "favicon.ico"
FAVICON_MAX_AGE_S = 86400

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
    ("/admin/placements", "Placements"),
    ("/admin/groups", "Groups"),
    ("/admin/jobs", "Jobs"),
    ("/admin/api-keys", "Keys"),
    ("/admin/payouts", "Payouts"),
    ("/admin/audits", "Audits"),
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
    config = settings(request)
    return _page(request, "landing.html", source="/stats", data=data,
                 load_error=_load_error(status, "/stats"), columns=PUBLIC_MODEL_COLUMNS,
                 api_base=str(request.base_url) + "v1", example_model="MODEL_NAME",
                 auth_open=config.auth == "open",
                 worker_url=worker_url(getattr(config, "public_url", None),
                                       str(request.base_url)),
                 download_url=config.worker_download_url, variants=VARIANTS,
                 pays=pay_sentence(reports.worker_terms(request.app.state.queen)))


@router.get("/favicon.ico")
async def favicon() -> Response:
    """The logo as a real .ico (16, 32 and 48 px), for browsers and tools that ask for it
    before (or instead of) reading the pages' ``<link rel="icon">``."""
    return FileResponse(FAVICON, media_type="image/x-icon",
                        headers={"Cache-Control": f"public, max-age={FAVICON_MAX_AGE_S}"})


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


@router.get("/admin/placements", response_class=HTMLResponse)
async def placements(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/placements",
                             reports.placements, "/admin/placements",
                             columns=PLACEMENT_COLUMNS, title="Placements", row_key="model",
                             intro="Models being fetched onto workers for developers who asked "
                             "for them (models on demand).",
                             empty="No model is being placed now.")


@router.get("/admin/groups", response_class=HTMLResponse)
async def groups(request: Request) -> Response:
    """Model groups (issue 19): the live groups, and the models without one and why."""
    return await _admin_page(request, "admin_groups.html", "/admin/api/groups",
                             reports.groups, "/admin/groups", columns=GROUP_COLUMNS,
                             model_columns=UNGROUPED_COLUMNS)


@router.get("/admin/jobs", response_class=HTMLResponse)
async def jobs(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/jobs", reports.jobs,
                             "/admin/jobs", columns=JOB_COLUMNS, title="Recent jobs",
                             row_key="id", intro="The latest jobs, newest first.",
                             empty="No jobs yet.")


@router.get("/admin/api-keys", response_class=HTMLResponse)
async def keys(request: Request) -> Response:
    if not admin_authorized(request):
        return login_redirect(request)
    return await _keys_page(request)


async def _keys_page(request: Request, status_code: int = 200, *, notice: str | None = None,
                     error: FormError | None = None, created: str | None = None,
                     form: dict[str, str] | None = None) -> Response:
    """The Keys page: the live table of keys, and the forms that act on them. ``created`` is
    a new key's secret, shown on this one answer only (admin pages are ``no-store``)."""
    status, data = await load(request, "/admin/keys", reports.api_keys)
    return _page(request, "admin_keys.html", status_code, admin=True, source="/admin/keys",
                 data=data, active="/admin/api-keys", load_error=_load_error(status, "/admin/keys"),
                 columns=KEY_COLUMNS, csrf=csrf_token(request) or "", notice=notice,
                 error=error, created=created, form=form or {},
                 # A fresh reference per page: a credit posted twice (a reload, a double click)
                 # is credited once.
                 credit_ref="page-" + secrets.token_hex(8))


@router.post("/admin/api-keys", response_class=HTMLResponse)
async def keys_action(request: Request) -> Response:
    """Make, credit or revoke a key from the page's forms, with ``billing.admin`` as the CLI.

    A cookie-authenticated POST from another site's page was refused (403) by the session's
    ``Origin`` check before this runs; the form must also carry the session's token. Every
    field is read before anything is written; an error is shown on the page with what was
    typed, and changes nothing.
    """
    if not admin_authorized(request):
        return login_redirect(request)
    form = await read_form(request)
    if form is None:
        return await _keys_page(request, 413, error=FormError("", "That form was too large."))
    if not csrf_valid(request, form.get("csrf")):
        log.warning("admin keys form from %s refused: no valid form token",
                    client_address(request))
        return await _keys_page(request, 403, error=FormError(
            "", "This form is out of date (you logged in again since it was loaded, or it did "
                "not come from this page). Nothing was changed: try again below."))
    typed = {k: v for k, v in form.items() if k not in {"csrf", "ref"}}
    try:
        action = parse_key_form(form)
        keys_, store = reports.key_stores(request.app.state.queen)
        notice, created = await _apply(request, action, keys_, store)
    except FormError as problem:
        return await _keys_page(request, 400, error=problem, form=typed)
    except ApiError as problem:
        return await _keys_page(request, problem.status_code, form=typed,
                                error=FormError("key", problem.message))
    await request.app.state.queen.billing.refresh()  # the running queen sees it at once
    return await _keys_page(request, 201 if created else 200, notice=notice, created=created)


async def _apply(request: Request, action: KeyAction, keys_: KeyStore,
                 store: LedgerStore) -> tuple[str, str | None]:
    """Carry out one action; returns the notice to show and a new key's secret (or None)."""
    who = client_address(request)
    if isinstance(action, CreateKey):
        secret, record = await create_key(
            keys_, store, action.name, credit_msat=action.credit_msat,
            rpm_limit=action.rpm_limit, concurrency_limit=action.concurrency_limit,
            budget_msat=action.budget_msat)
        log.info("admin page (%s): created key %d (%s) with %d msat", who, record.id,
                 record.name, action.credit_msat)
        return (f"Made key {record.id} ({record.name}) with {fmt(action.credit_msat, 'sats')} "
                "sats."), secret
    if isinstance(action, CreditKey):
        record, applied = await credit_key(keys_, store, action.key, action.msat, action.ref)
        log.info("admin page (%s): credit of %d msat to key %d %s", who, action.msat, record.id,
                 "applied" if applied else "already applied (same reference)")
        if not applied:
            return (f"That credit to key {record.id} ({record.name}) was already made (the form "
                    "was sent twice); nothing more was added."), None
        return f"Added {fmt(action.msat, 'sats')} sats to key {record.id} ({record.name}).", None
    record, changed = await revoke_key(keys_, action.key)
    if not changed:
        raise FormError("key", f"Key {record.id} ({record.name}) is already revoked.")
    log.info("admin page (%s): revoked key %d (%s)", who, record.id, record.name)
    return (f"Revoked key {record.id} ({record.name}): it is refused from now on.", None)


@router.get("/admin/payouts", response_class=HTMLResponse)
async def payouts(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/payouts",
                             reports.payouts, "/admin/payouts", columns=PAYOUT_COLUMNS,
                             title="Payouts", row_key="id",
                             intro="Payouts to workers, newest first.",
                             empty="No payouts yet.")


# --- audits -----------------------------------------------------------------------------------

AUDITS_SOURCE = "/admin/api/audits"
FLASH_COOKIE = "apiary_audits_flash"  # the notice shown once after a flag is cleared


async def _audits_page(request: Request, status_code: int = 200, *, notice: str | None = None,
                       error: str | None = None) -> Response:
    """The Audits page: the cost summary and the recent audits poll ``/admin/api/audits``; the
    standings and each flag's evidence are drawn on the server (reload for changes), since
    each flagged worker carries a form."""
    status, data = await load(request, AUDITS_SOURCE, reports.audits)
    missing = status == 404  # no database: no audits to show
    return _page(request, "audits.html", status_code, admin=True,
                 source=None if missing else AUDITS_SOURCE, data=data, active="/admin/audits",
                 load_error=None if missing else _load_error(status, AUDITS_SOURCE),
                 missing=missing, columns=AUDIT_COLUMNS, csrf=csrf_token(request) or "",
                 notice=notice, error=error, quote=quote)


@router.get("/admin/audits", response_class=HTMLResponse)
async def audits(request: Request) -> Response:
    if not admin_authorized(request):
        return login_redirect(request)
    flash = request.cookies.get(FLASH_COOKIE)
    response = await _audits_page(request, notice=unquote(flash) if flash else None)
    if flash:
        response.delete_cookie(FLASH_COOKIE, path="/admin/audits", httponly=True,
                               samesite="strict", secure=secure_cookie(request))
    return response


@router.post("/admin/audits/{worker_id}/clear", response_class=HTMLResponse)
async def audits_clear(request: Request, worker_id: str) -> Response:
    """Clear a worker's flag from the page's button, with ``reports.clear_flag`` as the API.

    Guarded as the Keys page's forms: the session's ``Origin`` check (403 before this runs)
    and the per-session form token. Success redirects back (303) with a one-time notice, so a
    reload does not post again; an unknown or unflagged worker shows the 404's message."""
    if not admin_authorized(request):
        return login_redirect(request)
    form = await read_form(request)
    if form is None:
        return await _audits_page(request, 413, error="That form was too large.")
    if not csrf_valid(request, form.get("csrf")):
        log.warning("admin audits form from %s refused: no valid form token",
                    client_address(request))
        return await _audits_page(request, 403, error=(
            "This form is out of date (you logged in again since it was loaded, or it did not "
            "come from this page). Nothing was changed: try again below."))
    try:
        cleared = await reports.clear_flag(request.app.state.queen, worker_id)
    except ApiError as problem:
        return await _audits_page(request, problem.status_code, error=problem.message)
    log.info("admin page (%s): cleared worker %s's flag", client_address(request),
             cleared["worker"])
    response = RedirectResponse("/admin/audits", status_code=303)
    notice = (f"Cleared worker {cleared['worker']}'s flag: it gets work again, its test starts "
              "over and what the flag forfeited is paid back.")
    response.set_cookie(FLASH_COOKIE, quote(notice), max_age=60, path="/admin/audits",
                        httponly=True, samesite="strict", secure=secure_cookie(request))
    return response
