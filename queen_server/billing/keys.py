"""Developers' API keys: made once, shown once, stored only as a sha256 hash."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from queen_server.errors import KeyNotFound
from queen_server.storage.tables import ApiKey

KEY_PREFIX = "sk-apiary-"


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked: bool
    rpm_limit: int | None
    concurrency_limit: int | None
    budget_msat: int | None

    @classmethod
    def of(cls, row: Any) -> KeyRecord:
        """From an ``ApiKey`` row (ORM object or Core row)."""
        return cls(row.id, row.name, row.prefix, row.created_at, row.revoked_at is not None,
                   row.rpm_limit, row.concurrency_limit, row.budget_msat)


class KeyStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def create(
        self,
        name: str,
        *,
        rpm_limit: int | None = None,
        concurrency_limit: int | None = None,
        budget_msat: int | None = None,
    ) -> tuple[str, KeyRecord]:
        """A new key: returns the secret (shown once, never stored) and its record."""
        secret = new_secret()
        now = datetime.now(UTC)
        prefix = secret[:14]
        async with self.engine.begin() as conn:
            key_id = (await conn.execute(
                insert(ApiKey).values(
                    name=name, key_hash=hash_secret(secret), prefix=prefix, created_at=now,
                    rpm_limit=rpm_limit, concurrency_limit=concurrency_limit,
                    budget_msat=budget_msat,
                ).returning(ApiKey.id)
            )).scalar_one()
        return secret, KeyRecord(key_id, name, prefix, now, False, rpm_limit, concurrency_limit,
                                 budget_msat)

    async def all(self) -> dict[str, KeyRecord]:
        """Every key by its hash."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(ApiKey))).all()
        return {row.key_hash: KeyRecord.of(row) for row in rows}

    async def find(self, id_or_prefix: str) -> KeyRecord:
        records = (await self.all()).values()
        matches = [r for r in records
                   if str(r.id) == id_or_prefix or r.prefix.startswith(id_or_prefix)]
        if len(matches) != 1:
            what = "no key" if not matches else f"{len(matches)} keys"
            raise KeyNotFound(f"{what} match {id_or_prefix!r}; use the id from `keys list`")
        return matches[0]

    async def revoke(self, key_id: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(update(ApiKey).where(ApiKey.id == key_id)
                               .values(revoked_at=datetime.now(UTC)))
