"""Key administration, shared by the ``apiary-queen keys`` commands, the ``/admin`` API and the
admin Keys page, so that all three make, credit and revoke keys the same way.

Each operation either happens whole or not at all: a key whose initial credit cannot be written
is revoked again before the error goes up, and a revoked key is credited nothing (its money
could never be spent).
"""

from __future__ import annotations

import logging
import secrets

from queen_server.billing import ledger
from queen_server.billing.keys import KeyRecord, KeyStore
from queen_server.billing.store import LedgerStore
from queen_server.errors import InvalidRequest
from shared_schema.admin_types import KeyView

log = logging.getLogger(__name__)


def sats_to_msat(sats: float) -> int:
    if sats < 0:
        raise ValueError("amounts must not be negative")
    return round(sats * 1000)


async def view(record: KeyRecord, store: LedgerStore) -> KeyView:
    balances = await store.balances(f"key:{record.id}:")
    return KeyView(
        id=record.id, name=record.name, prefix=record.prefix, created_at=record.created_at,
        revoked=record.revoked,
        available_msat=balances.get(ledger.key_available(record.id), 0),
        reserved_msat=balances.get(ledger.key_reserved(record.id), 0),
        rpm_limit=record.rpm_limit, concurrency_limit=record.concurrency_limit,
        budget_msat=record.budget_msat,
    )


async def create_key(
    keys: KeyStore,
    store: LedgerStore,
    name: str,
    *,
    credit_msat: int = 0,
    rpm_limit: int | None = None,
    concurrency_limit: int | None = None,
    budget_msat: int | None = None,
) -> tuple[str, KeyRecord]:
    secret, record = await keys.create(name, rpm_limit=rpm_limit,
                                       concurrency_limit=concurrency_limit,
                                       budget_msat=budget_msat)
    if credit_msat:
        try:
            await store.post(ledger.deposit(record.id, credit_msat,
                                            f"deposit:create:{record.id}", "initial credit"))
        except Exception:
            # A key without the credit it was made with is not what was asked for: take it
            # out of use before the error goes up (its secret was never shown).
            log.exception("key %d: the initial credit failed; revoking the key", record.id)
            await keys.revoke(record.id)
            raise
    return secret, record


async def credit_key(
    keys: KeyStore, store: LedgerStore, id_or_prefix: str, msat: int, ref: str | None
) -> tuple[KeyRecord, bool]:
    """Add money to a key; the same ``ref`` credits once. Returns the key and whether it did.

    Raises ``KeyNotFound`` for no key (or several) matching, and ``InvalidRequest``
    (``key_revoked``) for a revoked key."""
    record = await keys.find(id_or_prefix)
    if record.revoked:
        raise InvalidRequest(f"Key {record.id} ({record.name}) is revoked: its sats could never "
                             "be spent, so it cannot be credited.", code="key_revoked")
    txn = f"deposit:{record.id}:{ref or secrets.token_hex(8)}"
    applied = await store.post(ledger.deposit(record.id, msat, txn, "credit"))
    return record, applied


async def revoke_key(keys: KeyStore, id_or_prefix: str) -> tuple[KeyRecord, bool]:
    """Revoke a key. Returns its record as it is now and whether this call revoked it (False:
    it was revoked already). Raises ``KeyNotFound`` for no key (or several) matching."""
    record = await keys.find(id_or_prefix)
    if record.revoked:
        return record, False
    await keys.revoke(record.id)
    return await keys.find(str(record.id)), True


async def list_keys(keys: KeyStore, store: LedgerStore) -> list[KeyView]:
    return [await view(record, store)
            for record in sorted((await keys.all()).values(), key=lambda r: r.id)]
