"""Payouts to workers over Lightning, recorded before they are paid.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "payouts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("worker_key", sa.String(64), nullable=False, index=True),
        sa.Column("amount_msat", sa.BigInteger, nullable=False),
        sa.Column("ln_url", sa.String(2048), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("bolt11", sa.Text),
        sa.Column("payment_hash", sa.String(64)),
        sa.Column("detail", sa.String(500), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("payouts")
