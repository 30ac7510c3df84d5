"""The /admin/keys API: the same operations as `apiary-queen keys`, behind the admin token."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.queen import running_queen
from tests.support.workers import ECHO_MODEL, ScriptedWorker

ADMIN = {"Authorization": "Bearer admin-secret"}


async def test_the_admin_api_is_off_without_a_token(queen):
    async with httpx.AsyncClient(base_url=queen.base_url) as http:
        response = await http.get("/admin/keys", headers=ADMIN)
    assert response.status_code == 404
    assert "APIARY_ADMIN_TOKEN" in response.json()["error"]["message"]


async def test_keys_over_the_admin_api(tmp_path, db_url):
    async with running_queen(tmp_path, auth="keys", db=db_url,
                             admin_token="admin-secret") as queen, \
            httpx.AsyncClient(base_url=queen.base_url) as http:
        worker = await ScriptedWorker(queen.ws_url).start()
        try:
            wrong = await http.get("/admin/keys", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert wrong.json()["error"]["code"] == "invalid_admin_token"

            made = await http.post("/admin/keys", headers=ADMIN,
                                   json={"name": "carol", "credit_sats": 3, "rpm_limit": 100})
            assert made.status_code == 201
            key = made.json()
            assert key["key"].startswith("sk-apiary-")
            assert (key["available_msat"], key["rpm_limit"]) == (3000, 100)
            # The new key works at once: no waiting for the refresh poll.
            client = queen.client(api_key=key["key"])
            await client.chat.completions.create(model=ECHO_MODEL,
                                                 messages=[{"role": "user", "content": "hi"}])

            credit = {"sats": 2, "ref": "inv-1"}
            first = (await http.post(f"/admin/keys/{key['id']}/credit", headers=ADMIN,
                                     json=credit)).json()
            again = (await http.post(f"/admin/keys/{key['id']}/credit", headers=ADMIN,
                                     json=credit)).json()
            assert (first["applied"], again["applied"]) == (True, False)
            assert first["key"]["available_msat"] == again["key"]["available_msat"]

            listed = (await http.get("/admin/keys", headers=ADMIN)).json()
            assert [k["name"] for k in listed] == ["carol"]
            assert "key" not in listed[0]  # the secret is never shown again

            bad = await http.post("/admin/keys", headers=ADMIN, json={"name": ""})
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "name"
            missing = await http.post("/admin/keys/99/revoke", headers=ADMIN)
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "key_not_found"

            revoked = await http.post(f"/admin/keys/{key['id']}/revoke", headers=ADMIN)
            assert revoked.json()["revoked"] is True
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        finally:
            await worker.stop()
