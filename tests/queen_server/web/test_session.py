"""The admin session and the page plumbing, over HTTP (no browser), plus one check that the
page script formats every kind of value exactly as the server does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser

from queen_server.web import SESSION_COOKIE, formatting, pages, session
from tests.queen_server.web.support import ADMIN_TOKEN, new_page, queen_with_pages
from tests.support.queen import QueenHarness


@pytest.fixture
async def http(web_queen: QueenHarness) -> httpx.AsyncClient:
    # httpx's default 5 s read timeout is not the thing tested: a loaded CI machine once took
    # longer to serve a static file here.
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False,
                                 timeout=30) as client:
        yield client


async def logged_in(http: httpx.AsyncClient, next_page: str = "/admin") -> httpx.Response:
    return await http.post("/admin/login", data={"token": ADMIN_TOKEN, "next": next_page})


async def test_login_sets_a_signed_session_cookie(http: httpx.AsyncClient) -> None:
    response = await logged_in(http, "/admin/jobs")
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/jobs"
    cookie = response.headers["set-cookie"]
    for part in ("HttpOnly", "Max-Age=43200", "Path=/", "SameSite=lax"):
        assert part in cookie
    assert "Secure" not in cookie  # plain http here; https gets Secure
    page = await http.get("/admin/jobs")
    assert page.status_code == 200
    assert page.headers["cache-control"] == "no-store"
    assert "script-src 'self'" in page.headers["content-security-policy"]


@pytest.mark.parametrize("target", ["//evil.example/admin", "https://evil.example/",
                                    "/admin\\..\\evil", "/elsewhere", "/admin/login?next=/x",
                                    "/admin//evil.example"])
async def test_login_never_sends_you_off_the_admin_pages(http: httpx.AsyncClient,
                                                        target: str) -> None:
    response = await logged_in(http, target)
    assert response.status_code == 303
    assert response.headers["location"] == "/admin"


async def test_the_bearer_token_opens_the_pages_too(http: httpx.AsyncClient) -> None:
    response = await http.get("/admin/workers",
                              headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 200
    response = await http.get("/admin/workers", headers={"authorization": "Bearer wrong"})
    assert response.status_code == 303


async def test_expired_and_foreign_sessions_are_refused(
        http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = session.serializer("some other queen's token").dumps({"admin": True})
    http.cookies.set(SESSION_COOKIE, foreign)
    response = await http.get("/admin")
    assert response.status_code == 303
    http.cookies.clear()

    await logged_in(http)
    assert (await http.get("/admin")).status_code == 200
    monkeypatch.setattr(session, "SESSION_MAX_AGE_S", -1)  # every cookie is now too old
    response = await http.get("/admin")
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/login?next=%2Fadmin"
    assert (await http.get("/admin/api/workers")).status_code == 401


async def test_logout_clears_the_cookie(http: httpx.AsyncClient) -> None:
    await logged_in(http)
    response = await http.post("/admin/logout")
    assert response.status_code == 303
    assert response.headers["location"] == "/admin/login"
    assert f'{SESSION_COOKIE}=""' in response.headers["set-cookie"]
    assert (await http.get("/admin")).status_code == 303


async def test_a_new_admin_token_ends_old_sessions(tmp_path: Path) -> None:
    async with (queen_with_pages(tmp_path) as queen,
                httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client):
        await logged_in(client)
        assert (await client.get("/admin")).status_code == 200
        queen.state.settings.admin_token = "a rotated token"
        assert (await client.get("/admin")).status_code == 303


async def test_static_files_are_served(http: httpx.AsyncClient) -> None:
    for name in ("app.js", "app.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE",
                 "favicon.ico"):
        response = await http.get(f"/static/{name}")
        assert response.status_code == 200, name
    landing = (await http.get("/")).text
    assert pages.static_url("app.js") in landing
    assert "?v=" in pages.static_url("app.js")


CASES: list[tuple[object, str]] = [
    (None, "int"), ("", "text"), (0, "int"), (1234567, "int"), (2.5, "int"), (-3, "int"),
    (3.14159, "float1"), (0.05, "float2"), (1234.5678, "float3"), (12.345, "rate"),
    (0.123, "seconds"), (1.5, "seconds"), (0.0231, "spt"), (0.00042, "spt"), (0.00001, "spt"),
    (2.5, "spt"), (0.125, "pct"), (0, "pct"), (1, "pct"),
    (0, "sats"), (1, "sats"), (1000, "sats"), (1234, "sats"), (1234567890, "sats"),
    (100, "price"), (800, "price"),
    (512, "mb"), (24564, "mb"), (1024, "mb"),
    (135_000_000, "params"), (7_620_000_000, "params"), (1_000_000_000, "params"), (950, "params"),
    ([], "list"), (["a", "b"], "list"), (["o/m:Q4", "x"], "models"),
    ([], "gpus"), (["RTX 3090", "RTX 3090", "A6000"], "gpus"),
    ("2026-01-02T03:04:05.678+00:00", "time"), ("2026-01-02T03:04:05Z", "time"),
    ("2026-01-02T05:04:05+02:00", "time"), ("2026-01-02T03:04:05", "time"),
    (True, "online"), (False, "online"), (True, "revoked"), (False, "revoked"),
    ("ok", "outcome"), ("<b>x</b>", "text"), ("abc", "worker"),
    ({"workers_online": 0, "workers_with_gpu": 0, "gpus": 0}, "gpu_share"),
    ({"workers_online": 3, "workers_with_gpu": 1, "gpus": 1}, "gpu_share"),
    ({"workers_online": 1, "workers_with_gpu": 1, "gpus": 1}, "gpu_share"),
    ({"workers_online": 2, "workers_with_gpu": 2, "gpus": 5}, "gpu_share"),
    ({"workers_online": 2000, "workers_with_gpu": 1500, "gpus": 1600}, "gpu_share"),
    ({"workers_online": 2}, "gpu_share"), ([1, 2], "gpu_share"), (None, "gpu_share"),
]


async def test_the_page_script_formats_like_the_server(web_queen: QueenHarness,
                                                       browser: Browser) -> None:
    page = await new_page(browser)
    await page.goto(web_queen.base_url + "/")
    shown = await page.evaluate("(cases) => cases.map(([v, k]) => window.Apiary.fmt(v, k))",
                                [[value, kind] for value, kind in CASES])
    expected = [formatting.fmt(value, kind) for value, kind in CASES]
    assert [(case, a, b) for case, a, b in zip(CASES, shown, expected, strict=True) if a != b] == []
    # Durations ("ago") against each one's own clock.
    started = (datetime.now(UTC) - timedelta(minutes=3, seconds=7)).isoformat()
    ago = await page.evaluate("(v) => window.Apiary.fmt(v, 'ago')", started)
    assert ago == formatting.fmt(started, "ago") == "3m 7s"
