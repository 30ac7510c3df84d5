"""The queen's admin API bodies (``/admin/keys``), guarded by the admin token."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import Field, field_validator

from shared_schema.base import WireModel

# Every sat there will ever be (21 million BTC): amounts past it are refused at the edge, so the
# millisat values stay well inside SQLite's 64-bit integers. Limits are capped the same way.
MAX_SATS = 21_000_000 * 100_000_000
MAX_LIMIT = 2**31 - 1


class KeyCreate(WireModel):
    name: str = Field(min_length=1, max_length=200)
    credit_sats: float = Field(default=0, ge=0, le=MAX_SATS)
    rpm_limit: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    concurrency_limit: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    budget_sats: float | None = Field(default=None, ge=0, le=MAX_SATS)


class KeyCredit(WireModel):
    sats: float = Field(ge=0.001, le=MAX_SATS, description="At least one millisat.")
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

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        """Times are stored in UTC; SQLite hands them back naive, which is no RFC 3339 time."""
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


class KeyCreated(KeyView):
    key: str = Field(description="The secret key. Shown once: only its hash is stored.")


class KeyCredited(WireModel):
    key: KeyView
    applied: bool = Field(description="False if this ref was already credited.")


class ModelRepin(WireModel):
    """``POST /admin/api/models/repin``: pin a hub model name to the file the hub holds now."""

    model: str = Field(min_length=1, max_length=512,
                       description="A hub model name (hf-user/hf-repo:filter).")
