"""The queen's tables (SQLAlchemy 2). Alembic migrations in ``migrations/`` create them.

Money is integer millisatoshis. Every movement is a ``LedgerTxn`` whose ``LedgerEntry`` rows sum
to zero; ``Account.balance_msat`` caches the sum of an account's entries and ``ledger check``
verifies it against them.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class WorkerRecord(Base):
    __tablename__ = "workers"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_id: Mapped[str] = mapped_column(String(16), index=True)
    ln_url: Mapped[str | None] = mapped_column(String(2048))
    worker_version: Mapped[str] = mapped_column(String(64), default="")
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    jobs_settled: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    jobs_served: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    timeouts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    uptime_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")


class WorkerSpeed(Base):
    """A worker's seconds per token on one model size class (EMAs)."""

    __tablename__ = "worker_speeds"

    worker_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_class: Mapped[str] = mapped_column(String(32), primary_key=True)
    prompt_s_per_token: Mapped[float | None] = mapped_column(Float)
    completion_s_per_token: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)
    budget_msat: Mapped[int | None] = mapped_column(BigInteger)


class LedgerTxn(Base):
    """One movement of money; its id is the idempotency key (e.g. ``settle:<job id>``)."""

    __tablename__ = "ledger_txns"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(32))
    memo: Mapped[str] = mapped_column(String(500), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LedgerEntry(Base):
    __tablename__ = "ledger_entries"
    __table_args__ = (Index("ix_ledger_entries_account", "account"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    txn_id: Mapped[str] = mapped_column(ForeignKey("ledger_txns.id"), index=True)
    account: Mapped[str] = mapped_column(String(200))
    amount_msat: Mapped[int] = mapped_column(BigInteger)


class Account(Base):
    __tablename__ = "accounts"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    balance_msat: Mapped[int] = mapped_column(BigInteger, default=0)
    is_liability: Mapped[bool] = mapped_column(Boolean, default=True)


class JobChargeRow(Base):
    """What a settled job was billed: its usage and the rates it was priced at, written with
    its settle posting, so that an audit's exact counts can re-price it (issue 39)."""

    __tablename__ = "job_charges"

    job_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    key_id: Mapped[int] = mapped_column(Integer)
    size_class: Mapped[str] = mapped_column(String(32))
    prompt_msat_per_1k: Mapped[int] = mapped_column(BigInteger)
    completion_msat_per_1k: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    charge_msat: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Payout(Base):
    """A payout to a worker. States: ``recorded`` (money moved to in-flight, no invoice yet),
    ``invoiced`` (invoice stored, payment may have been sent), ``paid``, ``failed`` (money
    returned), ``manual`` (no Lightning backend: an admin settles it by hand)."""

    __tablename__ = "payouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_key: Mapped[str] = mapped_column(String(64), index=True)
    amount_msat: Mapped[int] = mapped_column(BigInteger)
    ln_url: Mapped[str] = mapped_column(String(2048))
    state: Mapped[str] = mapped_column(String(16), index=True)
    bolt11: Mapped[str | None] = mapped_column(Text)
    payment_hash: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(String(500), default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AuditStandingRow(Base):
    """A worker's audit record (``audits.decision.Standing``) and what its flag did."""

    __tablename__ = "audit_standings"

    worker_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="unknown")
    llr: Mapped[float] = mapped_column(Float, default=0.0)
    audited: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    reasons: Mapped[str] = mapped_column(Text, default="[]")  # JSON list, newest last
    flags: Mapped[int] = mapped_column(Integer, default=0)  # times flagged (names each forfeit)
    flagged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cleared_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    outvoted: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # as auditor


class AuditRecord(Base):
    """One audited job: whose answer, which auditor re-scored it, the scores and the verdict."""

    __tablename__ = "audits"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    request_id: Mapped[str] = mapped_column(String(200), index=True)
    worker_key: Mapped[str] = mapped_column(String(64), index=True)
    auditor_key: Mapped[str] = mapped_column(String(64))
    auditor_trusted: Mapped[bool] = mapped_column(Boolean, default=False)
    model: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str | None] = mapped_column(String(64))
    temperature: Mapped[float] = mapped_column(Float)
    answer_tokens: Mapped[int] = mapped_column(Integer)
    claimed_tokens: Mapped[int] = mapped_column(Integer)
    # The prompt: the tokens the worker was billed for, and the auditor's count (issue 39).
    claimed_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    positions: Mapped[int] = mapped_column(Integer)
    mismatches: Mapped[int] = mapped_column(Integer)
    z: Mapped[float] = mapped_column(Float)
    suspicion: Mapped[float | None] = mapped_column(Float)
    failed: Mapped[bool] = mapped_column(Boolean, default=False)
    reason: Mapped[str] = mapped_column(String(500), default="")
    key_id: Mapped[int | None] = mapped_column(Integer)
    charged_msat: Mapped[int] = mapped_column(BigInteger, default=0)
    refunded: Mapped[bool] = mapped_column(Boolean, default=False)
    audit_tokens: Mapped[int] = mapped_column(Integer, default=0)
    audit_s: Mapped[float] = mapped_column(Float, default=0.0)


class QueenSecret(Base):
    """A secret every replica of the queen shares, made at random by the first that needs it
    (``Database.shared_secret``): the key of the callers' prompt-cache scopes (issue 36)."""

    __tablename__ = "queen_secrets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(128))  # hex


class ModelPin(Base):
    """The reading a hub model name is pinned to (issue 39, ``catalog.pins``), whole, as JSON:
    what every replica and every later run of the queen uses until the operator re-pins it."""

    __tablename__ = "model_pins"

    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    facts: Mapped[str] = mapped_column(Text)
    pinned_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    pinned_by: Mapped[str] = mapped_column(String(32))  # "first reading" or "operator"


class StoredFile(Base):
    """A file uploaded through the Files API (issue 37): whose it is, what it is, and where its
    bytes are (``local:files/<id>`` or ``s3://bucket/files/<id>``). A deleted file keeps its row,
    marked, so that a list page's ``after`` cursor still finds its place; its bytes are gone."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_owner_seq", "owner", "seq"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # list order
    id: Mapped[str] = mapped_column(String(40), unique=True)
    owner: Mapped[str] = mapped_column(String(128))  # key:<id>, dev:<sha256>, or open
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    examples: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    location: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class FineTuningJobRow(Base):
    """A fine-tuning job (issue 37): what was asked, what the queen decided, where it stands."""

    __tablename__ = "fine_tuning_jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)  # as the files' owner
    key_id: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    model: Mapped[str] = mapped_column(String(512))
    training_file: Mapped[str] = mapped_column(String(128))
    validation_file: Mapped[str | None] = mapped_column(String(128))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer)
    n_epochs: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    learning_rate_multiplier: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(20), index=True)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(String(1000))
    error_param: Mapped[str | None] = mapped_column(String(64))
    fine_tuned_model: Mapped[str | None] = mapped_column(String(700), index=True)
    bound_tokens: Mapped[int] = mapped_column(BigInteger)  # the queen's bound on the job
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    held_msat: Mapped[int] = mapped_column(BigInteger, default=0)
    charged_msat: Mapped[int] = mapped_column(BigInteger, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    estimated_finish: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    metadata_json: Mapped[str | None] = mapped_column(String(20_000))
    worker_key: Mapped[str | None] = mapped_column(String(64))
    # Training on workers (0012): the current attempt (its transfers' token is valid only
    # while it runs), the most bytes one of its uploads may be, and the adapter it delivered.
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    upload_limit_bytes: Mapped[int | None] = mapped_column(BigInteger)
    adapter_location: Mapped[str | None] = mapped_column(String(1024))
    adapter_sha256: Mapped[str | None] = mapped_column(String(64))
    adapter_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    model_deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # 0013


class FineTuningEventRow(Base):
    """One event of a fine-tuning job, as ``/events`` lists them (newest first)."""

    __tablename__ = "fine_tuning_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    level: Mapped[str] = mapped_column(String(8))
    type: Mapped[str] = mapped_column(String(8))
    message: Mapped[str] = mapped_column(String(2000))
    data_json: Mapped[str | None] = mapped_column(String(4000))


class FineTuningCheckpointRow(Base):
    """A checkpoint a job's worker saved (its adapter so far, in the queen's storage)."""

    __tablename__ = "fine_tuning_checkpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    step: Mapped[int] = mapped_column(Integer)
    train_loss: Mapped[float | None] = mapped_column(Float)
    valid_loss: Mapped[float | None] = mapped_column(Float)
    location: Mapped[str] = mapped_column(String(1000))  # in the queen's file storage
    sha256: Mapped[str | None] = mapped_column(String(64))
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)


class FineTuningUploadRow(Base):
    """A file a training attempt's worker PUT, as the queen received and hashed it."""

    __tablename__ = "fine_tuning_uploads"
    __table_args__ = (UniqueConstraint("job_id", "attempt", "name",
                                       name="uq_fine_tuning_uploads_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(80))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    location: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ImageLinkRow(Base):
    """An image of a ``url`` answer (issue 38), kept in the files' storage until ``expires_at``;
    its link is its unguessable ``token`` (with the format's extension)."""

    __tablename__ = "image_links"

    token: Mapped[str] = mapped_column(String(64), primary_key=True)
    location: Mapped[str] = mapped_column(String(1024))
    output_format: Mapped[str] = mapped_column(String(8))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
