"""``/admin/keys``: the key operations of ``apiary-queen keys``, over HTTP, for the admin token.

Disabled (404) unless ``APIARY_ADMIN_TOKEN`` is set. Requests carry
``Authorization: Bearer <admin token>``, or the admin pages' session cookie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response

from queen_server import reports
from queen_server.billing.admin import create_key, credit_key, revoke_key, sats_to_msat, view
from queen_server.http.deps import json_response, require_admin
from queen_server.http.io import parse, read_body, request_schema
from shared_schema.admin_types import KeyCreate, KeyCreated, KeyCredit, KeyCredited, KeyView

if TYPE_CHECKING:
    from queen_server.billing.keys import KeyStore
    from queen_server.billing.store import LedgerStore
    from queen_server.runtime import QueenState

router = APIRouter(prefix="/admin", tags=["admin"])


def _admin(request: Request) -> tuple[QueenState, KeyStore, LedgerStore]:
    state = require_admin(request)  # the admin session cookie, or the bearer admin token
    return state, *reports.key_stores(state)


def _json(model: KeyView | KeyCredited, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code,
                    media_type="application/json")


@router.get("/keys", response_model=list[KeyView], summary="Every key, with its balance")
async def admin_list_keys(request: Request) -> Response:
    return json_response(await reports.api_keys(require_admin(request)))


@router.post("/keys", response_model=KeyCreated, status_code=201,
             summary="Make a key (its secret is in this answer only)",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": request_schema(KeyCreate)}}}})
async def admin_create_key(request: Request) -> Response:
    state, keys, store = _admin(request)
    body = parse(KeyCreate, await read_body(request, state.settings.max_body_bytes))
    budget = sats_to_msat(body.budget_sats) if body.budget_sats is not None else None
    secret, record = await create_key(
        keys, store, body.name, credit_msat=sats_to_msat(body.credit_sats),
        rpm_limit=body.rpm_limit, concurrency_limit=body.concurrency_limit, budget_msat=budget)
    await state.billing.refresh()
    created = KeyCreated(key=secret, **(await view(record, store)).model_dump())
    return _json(created, 201)


@router.post("/keys/{key_id}/credit", response_model=KeyCredited, summary="Add sats to a key",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": request_schema(KeyCredit)}}}})
async def admin_credit_key(key_id: int, request: Request) -> Response:
    state, keys, store = _admin(request)
    body = parse(KeyCredit, await read_body(request, state.settings.max_body_bytes))
    record, applied = await credit_key(keys, store, str(key_id), sats_to_msat(body.sats),
                                       body.ref)
    await state.billing.refresh()
    return _json(KeyCredited(key=await view(record, store), applied=applied))


@router.post("/keys/{key_id}/revoke", response_model=KeyView, summary="Revoke a key")
async def admin_revoke_key(key_id: int, request: Request) -> Response:
    state, keys, store = _admin(request)
    record, _ = await revoke_key(keys, str(key_id))  # revoking twice is no error here
    await state.billing.refresh()
    return _json(await view(record, store))

