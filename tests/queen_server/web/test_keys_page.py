"""The admin Keys page makes, credits and revokes keys: end to end in Chromium against a real
queen serving a real (scripted) worker, where each action must take effect on the running
queen at once; then every hostile or mistaken form over HTTP, each refused with a clear message
and changing nothing; and the form reader on its own."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from html import unescape
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from playwright.async_api import Browser, expect

from queen_server.billing.admin import create_key
from queen_server.web import SESSION_COOKIE
from queen_server.web.key_forms import CreateKey, CreditKey, FormError, RevokeKey, parse_key_form
from tests.queen_server.web.support import ADMIN_TOKEN, log_in, new_page, queen_with_pages
from tests.support.queen import QueenHarness
from tests.support.workers import ECHO_MODEL, ScriptedWorker

EVIL = "https://evil.example"
# The billing cache's own refresh is an hour away: whatever the queen sees at once, it sees
# because the page's action refreshed it.
SLOW_REFRESH = {"auth": "keys", "billing_refresh_s": 3600.0}


async def chat(queen: QueenHarness, secret: str) -> str:
    client = queen.client(secret)
    answer = await client.chat.completions.create(
        model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    return answer.choices[0].message.content or ""


# --- in Chromium ------------------------------------------------------------------------------

async def test_make_credit_and_revoke_a_key_from_the_page(tmp_path: Path,
                                                          browser: Browser) -> None:
    errors: list[str] = []
    async with queen_with_pages(tmp_path, **SLOW_REFRESH) as queen:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            page = await new_page(browser, errors)
            base = queen.base_url
            await log_in(page, base, then="/admin/api-keys")
            await expect(page.locator("h1")).to_have_text("API keys")
            await expect(page.locator("p.empty")).to_be_visible()

            # Make a key with no credit: its secret is shown once, and the queen knows it.
            await page.fill("#create-name", "alice's laptop")
            await page.click("#create-form button[type=submit]")
            await expect(page.locator("#keys-notice")).to_have_text(
                "Made key 1 (alice's laptop) with 0 sats.")
            secret = (await page.locator("#new-key").text_content() or "").strip()
            assert re.fullmatch(r"sk-apiary-[\w-]{43}", secret), secret
            row = page.locator('#rows tbody tr[data-key="1"]')
            await expect(row.locator("td").nth(1)).to_have_text("alice's laptop")
            with pytest.raises(openai.APIStatusError) as unpaid:
                await chat(queen, secret)
            assert unpaid.value.status_code == 402  # known at once, but nothing to spend

            # Credit it: the running queen serves it right away.
            await page.select_option("#credit-key", "1")
            await page.fill("#credit-sats", "1,000")
            await page.click("#credit-form button[type=submit]")
            await expect(page.locator("#keys-notice")).to_have_text(
                "Added 1,000 sats to key 1 (alice's laptop).")
            await expect(page.locator("#new-key")).to_have_count(0)  # never shown again
            assert secret not in await page.content()
            await expect(row.locator("td").nth(4)).to_have_text("1,000")
            assert await chat(queen, secret) == "echo: hi"

            # A mistake is shown on the page and changes nothing.
            await page.select_option("#credit-key", "1")
            await page.fill("#credit-sats", "-5")
            await page.click("#credit-form button[type=submit]")
            await expect(page.locator("#keys-error")).to_have_text(
                "Amount: an amount cannot be negative.")
            await expect(page.locator("#credit-sats")).to_have_value("-5")
            await expect(page.locator("#credit-sats")).to_have_attribute("aria-invalid", "true")
            spent = await row.locator("td").nth(4).text_content()
            assert spent is not None
            assert float(spent.replace(",", "")) < 1000

            # Revoking asks first: "no" sends nothing.
            await page.select_option("#revoke-key", "1")
            page.once("dialog", lambda dialog: dialog.dismiss())
            await page.click("#revoke-form button[type=submit]")
            await expect(row.locator("td").last).to_have_text("active")
            assert await chat(queen, secret) == "echo: hi"
            # "Yes": the key is refused from that moment.
            messages: list[str] = []

            async def accept(dialog: Any) -> None:
                messages.append(dialog.message)
                await dialog.accept()

            page.once("dialog", accept)
            await page.click("#revoke-form button[type=submit]")
            await expect(page.locator("#keys-notice")).to_have_text(
                "Revoked key 1 (alice's laptop): it is refused from now on.")
            assert messages
            assert messages[0].startswith("Revoke this key?")
            await expect(row.locator("td").last).to_have_text("revoked")
            await expect(page.locator("#revoke-key option")).to_have_count(1)  # only "Choose"
            with pytest.raises(openai.AuthenticationError):
                await chat(queen, secret)

            # Forged posts from the browser's own cookie jar: no token, or another site.
            before = await (await page.request.get(base + "/admin/keys")).json()
            token = await page.locator("#credit-form input[name=csrf]").get_attribute("value")
            no_token = await page.request.post(base + "/admin/api-keys", headers={"origin": base},
                                               form={"action": "create", "name": "forged"})
            assert no_token.status == 403
            assert "Nothing was changed" in await no_token.text()
            foreign = await page.request.post(
                base + "/admin/api-keys", headers={"origin": EVIL},
                form={"csrf": token or "", "action": "create", "name": "forged"})
            assert foreign.status == 403
            assert (await foreign.json())["error"]["code"] == "cross_origin_request"
            assert await (await page.request.get(base + "/admin/keys")).json() == before
        finally:
            await worker.stop()
    # The only console errors are the answers to the refused forms above.
    assert all("status of 40" in error for error in errors), errors
    assert await ledger_clean(tmp_path)


async def ledger_clean(tmp_path: Path) -> bool:
    """The ledger the test's queen left behind balances (checked with the CLI's own check)."""
    from queen_server.billing.store import LedgerStore
    from queen_server.storage.engine import Database

    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'queen.sqlite3'}")
    try:
        await db.upgrade()
        return (await LedgerStore(db.engine).check()).clean
    finally:
        await db.close()


# --- hostile and mistaken forms over HTTP ----------------------------------------------------

class Admin:
    """A logged-in admin's HTTP client, posting the Keys page's forms as the page would."""

    def __init__(self, http: httpx.AsyncClient, base: str) -> None:
        self.http = http
        self.base = base
        self.csrf = ""

    async def load(self) -> str:
        html = (await self.http.get("/admin/api-keys")).text
        found = re.search(r'name="csrf" value="([^"]*)"', html)
        assert found is not None
        self.csrf = found.group(1)
        return html

    async def post(self, headers: dict[str, str] | None = None, csrf: str | None = None,
                   **fields: str) -> httpx.Response:
        data = {"csrf": self.csrf if csrf is None else csrf, **fields}
        return await self.http.post("/admin/api-keys", data=data,
                                    headers={"origin": self.base, **(headers or {})})

    async def keys(self) -> list[dict[str, Any]]:
        return (await self.http.get("/admin/keys")).json()


def message(response: httpx.Response) -> str:
    found = re.search(r'id="keys-(?:error|notice)">([^<]*)<', response.text)
    assert found is not None, response.text[:500]
    return unescape(found.group(1))


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[QueenHarness, Admin]]:
    async with (queen_with_pages(tmp_path, **SLOW_REFRESH) as queen,
                httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as http):
        await http.post("/admin/login", data={"token": ADMIN_TOKEN, "next": "/admin"})
        assert SESSION_COOKIE in http.cookies
        page = Admin(http, queen.base_url)
        await page.load()
        yield queen, page


async def state_of(queen: QueenHarness, page: Admin) -> tuple[Any, ...]:
    """Everything a form could change: the keys, their balances, the whole ledger."""
    return (await page.keys(), await queen.state.billing.ledger.balances())


async def test_mistakes_are_explained_and_change_nothing(
        admin: tuple[QueenHarness, Admin]) -> None:
    queen, page = admin
    made = await page.post(action="create", name="bob", credit_sats="5")
    assert made.status_code == 201
    assert message(made) == "Made key 1 (bob) with 5 sats."
    revoked_one = await page.post(action="create", name="old")
    assert revoked_one.status_code == 201
    assert (await page.post(action="revoke", key="2")).status_code == 200
    before = await state_of(queen, page)

    cases = [
        ({"action": "credit", "key": "1", "sats": "-5"}, 400,
         "Amount: an amount cannot be negative."),
        ({"action": "credit", "key": "1", "sats": "1e30"}, 400,
         "Amount: 1e30 sats is more than every bitcoin there will ever be "
         "(2,100,000,000,000,000 sats)."),
        ({"action": "credit", "key": "1", "sats": "nan"}, 400,
         "Amount: 'nan' is not a number of sats."),
        ({"action": "credit", "key": "1", "sats": "lots"}, 400,
         "Amount: 'lots' is not a number of sats."),
        ({"action": "credit", "key": "1", "sats": ""}, 400, "Amount: enter a number of sats."),
        ({"action": "credit", "key": "1", "sats": "0.0001"}, 400,
         "Amount: enter at least 0.001 sats."),
        ({"action": "credit", "key": "", "sats": "5"}, 400, "Choose a key."),
        ({"action": "credit", "key": "99", "sats": "5"}, 404,
         "no key match '99'; use the id from `keys list`"),
        ({"action": "credit", "key": "2", "sats": "5"}, 400,
         "Key 2 (old) is revoked: its sats could never be spent, so it cannot be credited."),
        ({"action": "revoke", "key": "2"}, 400, "Key 2 (old) is already revoked."),
        ({"action": "revoke", "key": "99"}, 404,
         "no key match '99'; use the id from `keys list`"),
        ({"action": "create", "name": "  "}, 400,
         "Name: give the key a name (who or what it is for)."),
        ({"action": "create", "name": "x" * 201}, 400,
         "Name: at most 200 characters, on one line."),
        ({"action": "create", "name": "carol", "credit_sats": "-1"}, 400,
         "Starting credit: an amount cannot be negative."),
        ({"action": "create", "name": "carol", "credit_sats": "inf"}, 400,
         "Starting credit: 'inf' is not a number of sats."),
        ({"action": "create", "name": "carol", "budget_sats": "9" * 30}, 400,
         f"Spend budget: {'9' * 30} sats is more than every bitcoin there will ever be "
         "(2,100,000,000,000,000 sats)."),
        ({"action": "create", "name": "carol", "rpm_limit": "0"}, 400,
         "Requests per minute: enter a number from 1 to 2,147,483,647."),
        ({"action": "create", "name": "carol", "concurrency_limit": "1.5"}, 400,
         "Requests at once: enter a whole number, or leave it empty for no limit."),
        ({"action": "create", "name": "carol", "rpm_limit": "99999999999"}, 400,
         "Requests per minute: enter a number from 1 to 2,147,483,647."),
        ({"action": "delete_everything"}, 400, "Unknown action: use the page's own buttons."),
    ]
    for fields, status, expected in cases:
        response = await page.post(**fields)
        assert (response.status_code, message(response)) == (status, expected), fields
        assert await state_of(queen, page) == before, fields
    # What was typed is kept, so it can be fixed.
    kept = await page.post(action="create", name="carol", rpm_limit="0")
    assert 'value="carol"' in kept.text
    assert 'value="0"' in kept.text
    too_big = await page.post(action="create", name="x", filler="y" * 20_000)
    assert (too_big.status_code, message(too_big)) == (413, "That form was too large.")
    assert await state_of(queen, page) == before
    # The admin API shares the module, and so the rule: a revoked key is credited nothing.
    api = await page.http.post("/admin/keys/2/credit", json={"sats": 5},
                               headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert api.status_code == 400
    assert api.json()["error"]["code"] == "key_revoked"
    assert await state_of(queen, page) == before


async def test_forged_forms_are_refused_and_change_nothing(
        admin: tuple[QueenHarness, Admin], tmp_path: Path) -> None:
    queen, page = admin
    before = await state_of(queen, page)
    create = {"action": "create", "name": "forged", "credit_sats": "100"}

    no_token = await page.post(csrf="", **create)
    assert no_token.status_code == 403
    assert "Nothing was changed" in message(no_token)
    wrong_token = await page.post(csrf="0" * 64, **create)
    assert wrong_token.status_code == 403

    # Another session's token (a second login) is not this session's.
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as other:
        await other.post("/admin/login", data={"token": ADMIN_TOKEN, "next": "/admin"})
        theirs = Admin(other, queen.base_url)
        await theirs.load()
        assert theirs.csrf != page.csrf
        assert (await page.post(csrf=theirs.csrf, **create)).status_code == 403

    # The right token, from another site's page, or with no Origin or Referer at all.
    for headers in ({"origin": EVIL}, {"origin": "null"},
                    {"origin": queen.base_url.replace("127.0.0.1", "localhost")}):
        refused = await page.post(headers=headers, **create)
        assert refused.status_code == 403, headers
        assert refused.json()["error"]["code"] == "cross_origin_request"
    bare = await page.http.post("/admin/api-keys", data={"csrf": page.csrf, **create})
    assert bare.status_code == 403

    # The bearer token alone has no session, so no form token: scripts use POST /admin/keys.
    async with httpx.AsyncClient(base_url=queen.base_url, trust_env=False) as script:
        scripted = await script.post("/admin/api-keys", data={"csrf": page.csrf, **create},
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        assert scripted.status_code == 403
        # Logged out: to the login page.
        anonymous = await script.post("/admin/api-keys", data=create)
        assert anonymous.status_code == 303
        assert anonymous.headers["location"].startswith("/admin/login")
    assert await state_of(queen, page) == before

    # And the real page's form still works.
    assert (await page.post(**create)).status_code == 201


async def test_a_credit_sent_twice_is_credited_once(admin: tuple[QueenHarness, Admin]) -> None:
    _queen, page = admin
    await page.post(action="create", name="dave")
    html = await page.load()
    found = re.search(r'name="ref" value="([^"]+)"', html)
    assert found is not None
    credit = {"action": "credit", "key": "1", "sats": "250", "ref": found.group(1)}
    first, again = await asyncio.gather(page.post(**credit), page.post(**credit))
    notices = sorted([message(first), message(again)])
    assert notices == ["Added 250 sats to key 1 (dave).",
                       "That credit to key 1 (dave) was already made (the form was sent "
                       "twice); nothing more was added."]
    assert (await page.keys())[0]["available_msat"] == 250_000
    # A new page load is a new reference: a second credit on purpose goes through.
    await page.load()
    html = await page.load()
    ref = re.search(r'name="ref" value="([^"]+)"', html)
    assert ref is not None
    assert ref.group(1) != found.group(1)
    await page.post(**{**credit, "ref": ref.group(1)})
    assert (await page.keys())[0]["available_msat"] == 500_000


async def test_a_key_whose_credit_fails_is_not_left_usable(tmp_path: Path) -> None:
    class BrokenLedger:
        async def post(self, _txn: object) -> bool:
            raise OSError("disk full")

    async with queen_with_pages(tmp_path, auth="keys") as queen:
        keys = queen.state.billing.keys
        with pytest.raises(OSError, match="disk full"):
            await create_key(keys, BrokenLedger(), "eve", credit_msat=5000)  # type: ignore[arg-type]
        (record,) = (await keys.all()).values()
        assert record.name == "eve"
        assert record.revoked


# --- the form reader --------------------------------------------------------------------------

def test_the_form_reader_reads_what_people_type() -> None:
    assert parse_key_form({"action": "create", "name": " alice ", "credit_sats": "1 000.5",
                           "budget_sats": "", "rpm_limit": "60", "concurrency_limit": ""}) == \
        CreateKey("alice", 1_000_500, None, 60, None)
    assert parse_key_form({"action": "credit", "key": "sk-apiary-ab", "sats": "0.001",
                           "ref": ""}) == CreditKey("sk-apiary-ab", 1, None)
    assert parse_key_form({"action": "revoke", "key": "3"}) == RevokeKey("3")


@pytest.mark.parametrize("form", [
    {}, {"action": "create"}, {"action": "create", "name": "a\nb"},
    {"action": "create", "name": "a", "rpm_limit": "٣"},  # a digit, but not an ASCII one
    {"action": "credit", "key": "1", "sats": "1", "ref": "r" * 101},
    {"action": "credit", "key": "1", "sats": "-0.5"}, {"action": "revoke"},
])
def test_the_form_reader_refuses_bad_fields(form: dict[str, str]) -> None:
    with pytest.raises(FormError):
        parse_key_form(form)
