"""Initial schema: workers, API keys, the double-entry ledger and cached account balances.

The first release created ``workers`` with ``create_all`` and no migration; this revision adopts
such a table instead of failing on it.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    if "workers" not in sa.inspect(op.get_bind()).get_table_names():
        op.create_table(
            "workers",
            sa.Column("key", sa.String(64), primary_key=True),
            sa.Column("public_id", sa.String(16), nullable=False),
            sa.Column("ln_url", sa.String(2048)),
            sa.Column("worker_version", sa.String(64), nullable=False),
            sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
            sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        )
        op.create_index("ix_workers_public_id", "workers", ["public_id"])
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
        sa.Column("rpm_limit", sa.Integer),
        sa.Column("concurrency_limit", sa.Integer),
        sa.Column("budget_msat", sa.BigInteger),
    )
    op.create_table(
        "ledger_txns",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(200), nullable=False, unique=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("memo", sa.String(500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("txn_id", sa.String(200), sa.ForeignKey("ledger_txns.id"), nullable=False),
        sa.Column("account", sa.String(200), nullable=False),
        sa.Column("amount_msat", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_ledger_entries_account", "ledger_entries", ["account"])
    op.create_index("ix_ledger_entries_txn_id", "ledger_entries", ["txn_id"])
    op.create_table(
        "accounts",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("balance_msat", sa.BigInteger, nullable=False),
        sa.Column("is_liability", sa.Boolean, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("accounts")
    op.drop_index("ix_ledger_entries_txn_id", "ledger_entries")
    op.drop_index("ix_ledger_entries_account", "ledger_entries")
    op.drop_table("ledger_entries")
    op.drop_table("ledger_txns")
    op.drop_table("api_keys")
