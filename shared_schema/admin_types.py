"""The queen's admin API bodies (``/admin/keys``), guarded by the admin token."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from shared_schema.base import WireModel


class KeyCreate(WireModel):
    name: str = Field(min_length=1, max_length=200)
    credit_sats: float = Field(default=0, ge=0)
    rpm_limit: int | None = Field(default=None, ge=1)
    concurrency_limit: int | None = Field(default=None, ge=1)
    budget_sats: float | None = Field(default=None, ge=0)


class KeyCredit(WireModel):
    sats: float = Field(gt=0)
    ref: str | None = Field(default=None, max_length=100,
                            description="Idempotency reference: the same ref credits once.")


class KeyView(WireModel):
    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked: bool
    available_msat: int
    reserved_msat: int
    rpm_limit: int | None = None
    concurrency_limit: int | None = None
    budget_msat: int | None = None


class KeyCreated(KeyView):
    key: str = Field(description="The secret key. Shown once: only its hash is stored.")


class KeyCredited(WireModel):
    key: KeyView
    applied: bool = Field(description="False if this ref was already credited.")
