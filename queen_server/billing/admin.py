"""Key administration, shared by the ``apiary-queen keys`` commands and the ``/admin`` API."""

from __future__ import annotations

import secrets

from queen_server.billing import ledger
from queen_server.billing.keys import KeyRecord, KeyStore
from queen_server.billing.store import LedgerStore
from shared_schema.admin_types import KeyView


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
        await store.post(ledger.deposit(record.id, credit_msat, f"deposit:create:{record.id}",
                                        "initial credit"))
    return secret, record


async def credit_key(
    keys: KeyStore, store: LedgerStore, id_or_prefix: str, msat: int, ref: str | None
) -> tuple[KeyRecord, bool]:
    """Add money to a key; the same ``ref`` credits once. Returns the key and whether it did."""
    record = await keys.find(id_or_prefix)
    txn = f"deposit:{record.id}:{ref or secrets.token_hex(8)}"
    applied = await store.post(ledger.deposit(record.id, msat, txn, "credit"))
    return record, applied


async def list_keys(keys: KeyStore, store: LedgerStore) -> list[KeyView]:
    return [await view(record, store)
            for record in sorted((await keys.all()).values(), key=lambda r: r.id)]
