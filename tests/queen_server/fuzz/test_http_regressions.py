"""Plain regression tests for what fuzzing the HTTP API found.

1. ``POST /admin/keys/{id}/credit`` with ``sats: 7.6e307`` was a 500 (an infinite millisat
   amount), and ``POST /admin/keys`` with ``credit_sats: 1e300`` hung, then hung every later
   ledger write: the amount overflowed SQLite's integers inside the ledger's writer task.
2. The spec promised FastAPI's 422 for bad input, where the queen answers 400 in OpenAI's
   shape, and left out the 401/402/404/429 the routes answer.
3. Key times came back without a time zone (``"2026-11-22T19:55:02.904619"``), which is not the
   RFC 3339 ``date-time`` the spec promises.
4. A 405 had no ``Allow`` header; and where FastAPI made one route per method, ``Allow`` named
   only the first route's.
5. The published request schemas said ``additionalProperties: false`` though the queen ignores
   unknown fields in requests.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.queen import running_queen
from tests.support.workers import ScriptedWorker

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture
async def admin_queen(tmp_path):
    async with running_queen(tmp_path, auth="keys", admin_token="admin-secret") as queen:
        yield queen


@pytest.fixture
async def http(admin_queen):
    async with httpx.AsyncClient(base_url=admin_queen.base_url, headers=ADMIN,
                                 trust_env=False, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/keys", {"name": "huge", "credit_sats": 1e300}, "credit_sats"),
        ("/admin/keys", {"name": "huge", "budget_sats": 1e300}, "budget_sats"),
        ("/admin/keys", {"name": "huge", "rpm_limit": 10**30}, "rpm_limit"),
        ("/admin/keys/1/credit", {"sats": 7.6e307}, "sats"),
        ("/admin/keys/1/credit", {"sats": 5e-324}, "sats"),
    ],
)
async def test_amounts_past_every_bitcoin_are_a_400_and_the_ledger_keeps_working(
        http, path, body, param):
    made = await http.post("/admin/keys", json={"name": "first", "credit_sats": 1})
    assert made.status_code == 201
    refused = await http.post(path, json=body)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param
    # The ledger still takes writes: a credit is applied, at once.
    credited = await http.post(f"/admin/keys/{made.json()['id']}/credit", json={"sats": 2})
    assert credited.status_code == 200
    assert credited.json()["key"]["available_msat"] == 3000


async def test_key_times_carry_their_time_zone(http):
    made = await http.post("/admin/keys", json={"name": "tz"})
    listed = await http.get("/admin/keys")
    for created_at in (made.json()["created_at"], listed.json()[0]["created_at"]):
        assert created_at.endswith(("Z", "+00:00"))


async def test_the_spec_documents_the_errors_the_routes_answer(http):
    spec = (await http.get("/openapi.json")).json()
    operations = [(path, method, operation) for path, methods in spec["paths"].items()
                  for method, operation in methods.items()]
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, method, operation in operations:
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        for status, response in responses.items():
            if status.startswith(("4", "5")):
                assert response["content"]["application/json"]["schema"] == error_ref
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "402", "404", "429", "503"} <= set(chat)
    assert {"400", "401", "404"} <= set(spec["paths"]["/admin/keys/{key_id}/credit"]["post"][
        "responses"])
    assert "401" in spec["paths"]["/worker/earnings"]["get"]["responses"]
    request = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert request["additionalProperties"] is False  # unknown fields are refused, as parsed
    create = spec["paths"]["/admin/keys"]["post"]["requestBody"]["content"]["application/json"]
    assert "additionalProperties" not in create["schema"]


async def test_a_405_names_every_allowed_method(http):
    response = await http.request("TRACE", "/admin/keys")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, POST"
    assert response.json()["error"]["code"] == "http_405"
    hot = await http.get("/v1/chat/completions")
    assert hot.status_code == 405
    assert hot.headers["allow"] == "POST"


async def test_a_worker_signature_with_an_absurd_time_is_a_401(admin_queen):
    worker = await ScriptedWorker(admin_queen.ws_url).start()
    try:
        stamp = str(int(time.time())).rjust(5000, "0")
        async with httpx.AsyncClient(base_url=admin_queen.base_url, trust_env=False) as client:
            response = await client.get("/worker/earnings", headers={
                "Authorization": f"Apiary-Worker {worker.pubkey}.{stamp}.{'00' * 64}"})
        assert response.status_code == 401
    finally:
        await worker.stop()
