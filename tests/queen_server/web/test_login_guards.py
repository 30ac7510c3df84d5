"""The admin login's guards against an adversary, over real HTTP: a flood of wrong tokens, the
cookie's Secure flag behind a TLS proxy, and cross-origin POSTs carrying a valid cookie. The
deciding logic (``web/guard.py``) is tested on its own with a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from queen_server.web import SESSION_COOKIE
from queen_server.web.guard import LoginLimiter, origin_of, retry_after_header, same_origin
from tests.queen_server.web.support import ADMIN_TOKEN, queen_with_pages
from tests.support.queen import QueenHarness

EVIL = "https://evil.example"


@pytest.fixture
async def http(web_queen: QueenHarness) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=web_queen.base_url, trust_env=False) as client:
        yield client


def client_from(queen: QueenHarness, address: str) -> httpx.AsyncClient:
    """A client whose connections come from ``address`` (another loopback address is another
    client to the queen: no header says so, the socket does)."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    return httpx.AsyncClient(base_url=queen.base_url, transport=transport, trust_env=False)


async def log_in(client: httpx.AsyncClient, token: str = ADMIN_TOKEN,
                 **headers: str) -> httpx.Response:
    return await client.post("/admin/login", data={"token": token, "next": "/admin"},
                             headers=headers)


# --- the rate limit over HTTP ------------------------------------------------------------------

async def test_a_flood_of_wrong_tokens_is_throttled_while_others_log_in(
        web_queen: QueenHarness) -> None:
    async with (client_from(web_queen, "127.0.0.1") as attacker,
                client_from(web_queen, "127.0.0.2") as admin):
        statuses = [(await log_in(attacker, f"guess-{n}")).status_code for n in range(5)]
        assert statuses == [401] * 5
        refused = await log_in(attacker, "guess-5")
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert "Too many wrong tokens" in refused.text
        # Once throttled, even the right token is not checked from that address...
        right = await log_in(attacker)
        assert right.status_code == 429
        assert SESSION_COOKIE not in right.headers.get("set-cookie", "")
        # ...while the operator, at another address, logs in as usual.
        ok = await log_in(admin)
        assert ok.status_code == 303
        assert SESSION_COOKIE in ok.headers["set-cookie"]
        assert (await admin.get("/admin")).status_code == 200


async def test_right_tokens_do_not_use_up_the_allowance(web_queen: QueenHarness) -> None:
    async with client_from(web_queen, "127.0.0.3") as client:
        for _ in range(8):
            assert (await log_in(client)).status_code == 303
        assert (await log_in(client, "wrong")).status_code == 401


# --- the Secure flag ---------------------------------------------------------------------------

@pytest.mark.parametrize(("mode", "forwarded_proto", "secure"), [
    ("always", None, True),
    ("auto", "https", True),    # a TLS proxy on loopback (uvicorn trusts it) says https
    ("auto", None, False),      # plain http
    ("never", "https", False),
])
async def test_the_cookie_is_secure_when_configured(
        tmp_path: Path, mode: str, forwarded_proto: str | None, secure: bool) -> None:
    headers = {"x-forwarded-proto": forwarded_proto} if forwarded_proto else {}
    async with (queen_with_pages(tmp_path, admin_cookie_secure=mode) as queen,
                httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as client):
        response = await log_in(client, **headers)
        assert response.status_code == 303
        cookie = response.headers["set-cookie"]
        assert cookie.startswith(SESSION_COOKIE + "=")
        assert ("; Secure" in cookie or "; secure" in cookie) is secure
        logout = await client.post("/admin/logout", headers=headers)
        assert ("secure" in logout.headers["set-cookie"].lower()) is secure


# --- Origin on state-changing requests ---------------------------------------------------------

async def test_a_cross_origin_post_with_a_valid_cookie_is_refused(
        web_queen: QueenHarness, http: httpx.AsyncClient) -> None:
    assert (await log_in(http)).status_code == 303
    own = web_queen.base_url
    for headers in ({"origin": EVIL}, {"referer": EVIL + "/page"}, {"origin": "null"}, {},
                    {"origin": "http://127.0.0.1:1"}, {"origin": own.replace("http:", "https:")}):
        refused = await http.post("/admin/keys", json={"name": "stolen"}, headers=headers)
        assert refused.status_code == 403, headers
        error = refused.json()["error"]
        assert error["code"] == "cross_origin_request"
        assert error["type"] == "permission_error"
    keys = await http.get("/admin/keys")  # reading needs no Origin
    assert keys.status_code == 200
    assert keys.json() == []  # nothing was made

    made = await http.post("/admin/keys", json={"name": "mine"}, headers={"origin": own})
    assert made.status_code == 201
    key_id = made.json()["id"]
    credited = await http.post(f"/admin/keys/{key_id}/credit", json={"sats": 5},
                               headers={"referer": own + "/admin/api-keys"})
    assert credited.status_code == 200
    revoked = await http.post(f"/admin/keys/{key_id}/revoke", headers={"origin": EVIL})
    assert revoked.status_code == 403


async def test_bearer_token_scripts_are_unaffected(http: httpx.AsyncClient) -> None:
    await log_in(http)  # a stray cookie beside the token changes nothing
    made = await http.post("/admin/keys", json={"name": "script"},
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}", "origin": EVIL})
    assert made.status_code == 201
    http.cookies.clear()
    made = await http.post("/admin/keys", json={"name": "script2"},
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert made.status_code == 201


async def test_login_and_logout_from_another_site_are_refused(
        web_queen: QueenHarness, http: httpx.AsyncClient) -> None:
    refused = await log_in(http, origin=EVIL)
    assert refused.status_code == 403
    assert "set-cookie" not in refused.headers
    assert (await log_in(http, origin=web_queen.base_url)).status_code == 303
    refused = await http.post("/admin/logout", headers={"origin": EVIL})
    assert refused.status_code == 403
    assert (await http.get("/admin")).status_code == 200  # still logged in


# --- the deciding logic ------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_limiter_refills_over_the_window() -> None:
    clock = Clock()
    limiter = LoginLimiter(5, 100, clock=clock)
    for _ in range(5):
        assert limiter.retry_after("a") is None
        limiter.failed("a")
    wait = limiter.retry_after("a")
    assert wait == pytest.approx(12.0)  # one failure back every 60 / 5 s
    assert retry_after_header(wait) == "12"
    assert limiter.retry_after("b") is None
    clock.now += 12.0
    assert limiter.retry_after("a") is None
    limiter.failed("a")
    assert limiter.retry_after("a") == pytest.approx(12.0)


def test_the_overall_bucket_caps_many_addresses() -> None:
    clock = Clock()
    limiter = LoginLimiter(5, 10, clock=clock)
    for n in range(10):
        assert limiter.retry_after(f"10.0.0.{n}") is None
        limiter.failed(f"10.0.0.{n}")
    assert limiter.retry_after("10.9.9.9") == pytest.approx(6.0)  # 60 / 10 s
    clock.now += 6.0
    assert limiter.retry_after("10.9.9.9") is None


def test_the_limiter_remembers_a_bounded_number_of_addresses() -> None:
    clock = Clock()
    limiter = LoginLimiter(1, 10**9, clock=clock, max_addresses=100)
    for n in range(1000):
        limiter.failed(f"a{n}")
    assert len(limiter) == 100
    assert limiter.retry_after("a999") is not None
    assert limiter.retry_after("a0") is None  # forgotten, least recently seen


def test_origins_compare_scheme_host_and_port() -> None:
    own = "http://queen.example:8000/"
    assert same_origin("http://queen.example:8000", own, required=True)
    assert same_origin("HTTP://Queen.Example:8000/admin/x?y", own, required=True)
    assert not same_origin("https://queen.example:8000", own, required=True)
    assert not same_origin("http://queen.example", own, required=True)
    assert not same_origin("http://queen.example:8000.evil.example", own, required=True)
    assert not same_origin("null", own, required=True)
    assert not same_origin(None, own, required=True)
    assert same_origin(None, own, required=False)
    assert origin_of("https://q.example/") == ("https", "q.example", 443)
    assert origin_of("http://[::1]:99/") == ("http", "::1", 99)
    assert origin_of("http://q.example:notaport/") is None
    assert origin_of("javascript:alert(1)") is None
