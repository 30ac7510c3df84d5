"""The pages: ``/`` for developers, ``/admin/*`` for the operator, and the admin session.

Each page has one JSON source (``/stats`` or an ``/admin/api/*`` endpoint). The page is rendered
from that JSON on the server (fetched in-process, so the first paint needs no script), and
``static/app.js`` then polls the same URL and updates the bound elements, tables and charts in
place. The template declares the bindings (``data-field``, ``data-rows``, ``data-chart``); the
formatting here and in ``app.js`` is the same, kind by kind.

The admin session is a cookie signed with itsdangerous under a secret derived from the admin
token: changing ``APIARY_ADMIN_TOKEN`` ends every session. It holds no state on the server, so
logging out deletes the cookie and the cookie itself expires after 12 hours.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlencode

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, URLSafeTimedSerializer
from markupsafe import Markup, escape

from queen_server import __version__

if TYPE_CHECKING:
    from queen_server.settings import QueenSettings

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
TEMPLATE_DIR = HERE / "templates"
STATIC_PREFIX = "/static"

SESSION_COOKIE = "apiary_admin"
SESSION_MAX_AGE_S = 12 * 3600
REFRESH_MS = 3000
LOAD_TIMEOUT_S = 5.0
MAX_FORM_BYTES = 16 * 1024
DASH = "\u2014"

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
       "form-action 'self'")

router = APIRouter(include_in_schema=False)
router.mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="web-static")


# --- the admin session ------------------------------------------------------------------------

def _settings(request: Request) -> QueenSettings:
    return request.app.state.queen.settings


def _admin_token(request: Request) -> str | None:
    return _settings(request).admin_token or None


def _serializer(token: str) -> URLSafeTimedSerializer:
    secret = hmac.new(token.encode(), b"apiary admin session cookie", hashlib.sha256).digest()
    return URLSafeTimedSerializer(secret, salt="apiary-admin-session")


def admin_session_valid(request: Request) -> bool:
    """Whether the request carries an unexpired admin session cookie for the current token."""
    token = _admin_token(request)
    raw = request.cookies.get(SESSION_COOKIE)
    if not token or not raw:
        return False
    try:
        data = _serializer(token).loads(raw, max_age=SESSION_MAX_AGE_S)
    except BadSignature:  # includes SignatureExpired
        return False
    return isinstance(data, dict) and data.get("admin") is True


def _bearer_valid(request: Request, token: str) -> bool:
    scheme, _, given = (request.headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def admin_authorized(request: Request) -> bool:
    """The admin check for pages and the admin JSON API: a session cookie or the bearer token.

    False whenever no admin token is set (the admin pages and API are off then).
    """
    token = _admin_token(request)
    if not token:
        return False
    return _bearer_valid(request, token) or admin_session_valid(request)


def _session_cookie(token: str) -> str:
    return _serializer(token).dumps({"admin": True, "n": secrets.token_hex(8)})


def _safe_next(value: str | None) -> str:
    """Where to go after logging in: an admin page of this queen, never another site."""
    if (not value or not value.startswith("/admin") or value.startswith("/admin/login")
            or "//" in value or "\\" in value or any(ord(c) < 0x20 for c in value)):
        return "/admin"
    return value


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path
    if request.url.query:
        target += "?" + request.url.query
    return RedirectResponse("/admin/login?" + urlencode({"next": target}), status_code=303)


# --- formatting (mirrored by app.js) ----------------------------------------------------------

def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return None
        return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def _duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _seconds_per_token(value: float) -> str:
    if value >= 1:
        return f"{value:.2f}"
    if value < 0.0001:
        return "<0.0001"
    return f"{value:.2g}"


def _sats(msat: Any) -> str:
    text = f"{msat / 1000:,.3f}".rstrip("0").rstrip(".")
    return "0" if text in {"-0", ""} else text


def _params(count: Any) -> str:
    count = float(count)
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.1f}".removesuffix(".0") + suffix
    return f"{int(count)}"


def _gpus(names: Sequence[str]) -> str:
    if not names:
        return "none"
    counts = Counter(names)
    return ", ".join(name if n == 1 else f"{n}\u00d7 {name}" for name, n in counts.items())


def fmt(value: Any, kind: str = "text") -> str:
    """One value as the pages show it (``app.js`` has the same function)."""
    if value is None or value == "":
        return DASH
    try:
        match kind:
            case "int":
                return f"{math.floor(value + 0.5):,}"  # half up, as JavaScript's Math.round
            case "float1" | "float2" | "float3":
                return f"{float(value):,.{kind[-1]}f}"
            case "rate":
                return f"{float(value):,.1f}"
            case "seconds":
                return f"{float(value):.2f} s"
            case "spt":
                return _seconds_per_token(float(value))
            case "pct":
                return f"{float(value) * 100:.1f}%"
            case "sats" | "price":
                return _sats(value)
            case "mb":
                return (f"{value / 1024:.1f} GB" if value >= 1024
                        else f"{math.floor(value + 0.5):,} MB")
            case "params":
                return _params(value)
            case "list" | "models":
                return ", ".join(str(item) for item in value) if value else DASH
            case "gpus":
                return _gpus(value)
            case "time":
                parsed = _parse_time(value)
                return parsed.strftime("%Y-%m-%d %H:%M:%S") if parsed else str(value)
            case "ago":
                parsed = _parse_time(value)
                return _duration(time.time() - parsed.timestamp()) if parsed else str(value)
            case "online":
                return "online" if value else "offline"
            case "revoked":
                return "revoked" if value else "active"
            case _:
                return str(value)
    except (TypeError, ValueError):
        return str(value)


BADGES = {"online", "revoked", "outcome", "state"}
GOOD = {"online", "active", "ok", "paid", "settled", "succeeded", "done"}
BAD = {"offline", "revoked", "failed", "error", "timeout", "worker_lost", "expired"}


def _badge_class(text: str) -> str:
    if text in GOOD:
        return "badge good"
    if text in BAD or "error" in text or "fail" in text:
        return "badge bad"
    return "badge"


def short_model(name: str) -> str:
    """A model's name without its Hugging Face owner (the full name is in the title)."""
    return name.rsplit("/", 1)[-1]


def cell(value: Any, kind: str) -> Markup:
    """A table cell's content: text, a link to a worker, or a badge; always escaped."""
    text = fmt(value, kind)
    if kind == "worker" and value:
        return Markup('<a href="/admin/workers/{}">{}</a>').format(quote(str(value), safe=""),
                                                                    text)
    if kind in BADGES and value is not None:
        return Markup('<span class="{}">{}</span>').format(_badge_class(text), text)
    if kind == "models" and isinstance(value, list) and value:
        return Markup("").join(Markup('<span class="model" title="{}">{}</span>').format(
            name, short_model(str(name))) for name in value)
    if kind == "ago" and value:
        return Markup('<span title="{}">{}</span>').format(fmt(value, "time") + " UTC", text)
    return escape(text)


def lookup(data: Any, path: str) -> Any:
    """``a.b.0.c`` into nested dicts and lists; None when any step is missing."""
    if not path:
        return data
    for part in path.split("."):
        if isinstance(data, Mapping):
            data = data.get(part)
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return None
    return data


def aggregate(value: Any, agg: str | None, scale: float = 1) -> Any:
    """``len`` of a list, or ``sum:key`` over a list of points (times ``scale``)."""
    if not agg:
        return value
    if not isinstance(value, list):
        return None
    if agg == "len":
        return len(value)
    if agg.startswith("sum:"):
        key = agg[4:]
        return sum((point.get(key) or 0) for point in value if isinstance(point, Mapping)) * scale
    return None


def field(data: Any, path: str, kind: str = "text", agg: str | None = None,
          scale: float = 1, fallback: str | None = None) -> Markup:
    """A bound value's content, as ``app.js`` renders it."""
    value = aggregate(lookup(data, path), agg, scale)
    if value is None and fallback is not None:
        return escape(fallback)
    return cell(value, kind)


# --- columns ----------------------------------------------------------------------------------

NUMERIC = frozenset({"int", "float1", "float2", "float3", "rate", "seconds", "spt", "pct",
                     "sats", "price", "mb", "params"})


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    kind: str = "text"
    title: str = ""
    wrap: bool = False  # long values (model lists) wrap instead of widening the table

    @property
    def numeric(self) -> bool:
        return self.kind in NUMERIC


WORKER_COLUMNS = (
    Column("public_id", "Worker", "worker", "Short public id of the worker's key"),
    Column("version", "Version"),
    Column("gpus", "GPUs", "gpus", wrap=True),
    Column("vram_mb", "VRAM", "mb"),
    Column("models", "Models", "models", wrap=True),
    Column("sec_per_token", "s/token", "spt", "Seconds per completion token (EMA)"),
    Column("jobs", "Jobs", "int"),
    Column("failure_rate", "Failed", "pct", "Share of attempts that failed or timed out"),
    Column("earnings_msat", "Earned", "sats", "Sats earned: pending, available and paid"),
    Column("connected_since", "Connected", "ago", "Time since the current session began"),
    Column("online", "Status", "online"),
)
JOB_COLUMNS = (
    Column("at", "When (UTC)", "time"),
    Column("worker", "Worker", "worker"),
    Column("model", "Model", wrap=True),
    Column("prompt_tokens", "Prompt", "int", "Prompt tokens"),
    Column("completion_tokens", "Completion", "int", "Completion tokens"),
    Column("seconds", "Time", "seconds"),
    Column("ttft_s", "TTFT", "seconds", "Time to first token"),
    Column("outcome", "Outcome", "outcome"),
    Column("id", "Job id"),
)
WORKER_JOB_COLUMNS = tuple(c for c in JOB_COLUMNS if c.key != "worker")
MODEL_COLUMNS = (
    Column("id", "Model"),
    Column("workers", "Workers", "int", "Connected workers holding the model"),
    Column("loaded_on", "Loaded on", "int", "Workers with the model in memory"),
    Column("parameter_count", "Parameters", "params"),
    Column("price.size_class", "Size class"),
    Column("price.prompt_msat_per_1k", "Prompt sats/1k", "price", "sats per 1,000 prompt tokens"),
    Column("price.completion_msat_per_1k", "Completion sats/1k", "price",
           "sats per 1,000 completion tokens"),
)
PUBLIC_MODEL_COLUMNS = (
    Column("id", "Model", wrap=True),
    Column("workers", "Workers", "int"),
    Column("price.size_class", "Size class"),
    Column("price.prompt_msat_per_1k", "Prompt", "price", "sats per 1,000 prompt tokens"),
    Column("price.completion_msat_per_1k", "Completion", "price",
           "sats per 1,000 completion tokens"),
)
KEY_COLUMNS = (
    Column("id", "Id", "int"),
    Column("name", "Name"),
    Column("prefix", "Prefix"),
    Column("created_at", "Created (UTC)", "time"),
    Column("available_msat", "Available (sats)", "sats"),
    Column("reserved_msat", "Reserved (sats)", "sats"),
    Column("budget_msat", "Budget (sats)", "sats"),
    Column("rpm_limit", "Req/min", "int"),
    Column("concurrency_limit", "At once", "int"),
    Column("revoked", "Status", "revoked"),
)
PAYOUT_COLUMNS = (
    Column("id", "Id"),
    Column("worker", "Worker", "worker"),
    Column("amount_msat", "Amount (sats)", "sats"),
    Column("state", "State", "state"),
    Column("updated_at", "Updated (UTC)", "time"),
    Column("detail", "Detail", wrap=True),
)


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


async def _get(request: Request, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """One GET through this app's own ASGI stack: the same routing, auth and errors as a
    request from outside, with no socket and no HTTP client."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": request.url.scheme, "path": unquote(path), "raw_path": path.encode(),
        "root_path": "", "query_string": b"", "server": request.scope.get("server"),
        "client": ("127.0.0.1", 0), "state": dict(request.scope.get("state") or {}),
        "headers": [(b"host", (request.headers.get("host") or "localhost").encode()),
                    *((name.encode(), value.encode()) for name, value in headers.items())],
    }
    status = 0
    body = bytearray()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # no disconnect: LOAD_TIMEOUT_S ends a stuck call
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    async with asyncio.timeout(LOAD_TIMEOUT_S):
        await request.app(scope, receive, send)
    return status, bytes(body)


async def load(request: Request, path: str) -> tuple[int, Any]:
    """GET one of this queen's JSON endpoints in-process, as the page's script will.

    Returns the status (0 when the call failed) and the parsed JSON (None unless 200).
    """
    headers = {"accept": "application/json"}
    token = _admin_token(request)
    if token and path.startswith("/admin"):
        headers["authorization"] = f"Bearer {token}"
    try:
        status, body = await _get(request, path, headers)
    except Exception:
        log.exception("page %s: loading %s failed", request.url.path, path)
        return 0, None
    if status != 200:
        if status != 404:
            log.warning("page %s: %s answered %d", request.url.path, path, status)
        return status, None
    try:
        return 200, json.loads(body)
    except ValueError:
        log.warning("page %s: %s answered no JSON", request.url.path, path)
        return 0, None


def _load_error(status: int, path: str) -> str | None:
    if status == 200:
        return None
    if status == 0:
        return f"Could not load {path}; retrying."
    return f"{path} answered HTTP {status}; retrying."


async def _admin_page(request: Request, template: str, source: str, active: str,
                      **context: Any) -> Response:
    if not admin_authorized(request):
        return _login_redirect(request)
    status, data = await load(request, source)
    return _page(request, template, admin=True, source=source, data=data, active=active,
                 load_error=_load_error(status, source), **context)


# --- public pages -----------------------------------------------------------------------------

@router.get("/", response_class=HTMLResponse)
async def landing(request: Request) -> Response:
    status, data = await load(request, "/stats")
    # The examples name the first model on offer, or this placeholder while there is none.
    return _page(request, "landing.html", source="/stats", data=data,
                 load_error=_load_error(status, "/stats"), columns=PUBLIC_MODEL_COLUMNS,
                 api_base=str(request.base_url) + "v1", example_model="MODEL_NAME",
                 auth_open=_settings(request).auth == "open")


# --- login ------------------------------------------------------------------------------------

@router.get("/admin/login", response_class=HTMLResponse)
async def login_form(request: Request) -> Response:
    target = _safe_next(request.query_params.get("next"))
    if _admin_token(request) and admin_session_valid(request):
        return RedirectResponse(target, status_code=303)
    return _page(request, "login.html", enabled=_admin_token(request) is not None,
                 next=target, error=None)


async def _read_form(request: Request) -> dict[str, str] | None:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    parsed = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0] for name, values in parsed.items()}


@router.post("/admin/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    token = _admin_token(request)
    form = await _read_form(request)
    if form is None:
        return _page(request, "login.html", 413, enabled=token is not None, next="/admin",
                     error="That form was too large.")
    target = _safe_next(form.get("next"))
    if token is None:
        return _page(request, "login.html", 404, enabled=False, next=target, error=None)
    given = form.get("token", "").strip()
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        log.warning("admin login refused from %s", request.client.host if request.client else "?")
        return _page(request, "login.html", 401, enabled=True, next=target,
                     error="That is not the admin token.")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(SESSION_COOKIE, _session_cookie(token), max_age=SESSION_MAX_AGE_S,
                        path="/", httponly=True, samesite="lax",
                        secure=request.url.scheme == "https")
    return response


@router.post("/admin/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/admin/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="lax",
                           secure=request.url.scheme == "https")
    return response


# --- admin pages ------------------------------------------------------------------------------

@router.get("/admin", response_class=HTMLResponse)
async def overview(request: Request) -> Response:
    return await _admin_page(request, "admin_overview.html", "/admin/api/overview", "/admin")


@router.get("/admin/workers", response_class=HTMLResponse)
async def workers(request: Request) -> Response:
    return await _admin_page(request, "admin_workers.html", "/admin/api/workers",
                             "/admin/workers", columns=WORKER_COLUMNS)


@router.get("/admin/workers/{public_id}", response_class=HTMLResponse)
async def worker(request: Request, public_id: str) -> Response:
    if not admin_authorized(request):
        return _login_redirect(request)
    source = "/admin/api/workers/" + quote(public_id, safe="")
    status, data = await load(request, source)
    if status == 404:
        return _page(request, "admin_worker.html", 404, admin=True, active="/admin/workers",
                     public_id=public_id, data=None, columns=WORKER_JOB_COLUMNS,
                     load_error=None, missing=True)
    return _page(request, "admin_worker.html", admin=True, active="/admin/workers",
                 source=source, data=data, public_id=public_id, columns=WORKER_JOB_COLUMNS,
                 load_error=_load_error(status, source), missing=False)


@router.get("/admin/models", response_class=HTMLResponse)
async def models(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/models", "/admin/models",
                             columns=MODEL_COLUMNS, title="Models", row_key="id",
                             intro="Every model a connected worker holds, and its price.",
                             empty="No connected worker holds a model.")


@router.get("/admin/jobs", response_class=HTMLResponse)
async def jobs(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/jobs", "/admin/jobs",
                             columns=JOB_COLUMNS, title="Recent jobs", row_key="id",
                             intro="The latest jobs, newest first.", empty="No jobs yet.")


@router.get("/admin/api-keys", response_class=HTMLResponse)
async def keys(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/keys", "/admin/api-keys",
                             columns=KEY_COLUMNS, title="API keys", row_key="id",
                             intro="Developers' keys and their balances. Make and credit keys "
                                   "with apiary-queen keys, or POST /admin/keys.",
                             empty="No keys yet.")


@router.get("/admin/payouts", response_class=HTMLResponse)
async def payouts(request: Request) -> Response:
    return await _admin_page(request, "admin_table.html", "/admin/api/payouts",
                             "/admin/payouts", columns=PAYOUT_COLUMNS, title="Payouts",
                             row_key="id", intro="Payouts to workers, newest first.",
                             empty="No payouts yet.")

