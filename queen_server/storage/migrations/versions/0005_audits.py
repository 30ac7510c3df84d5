"""Audits of workers' answers (issue 16): each audited job and each worker's standing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_standings",
        sa.Column("worker_key", sa.String(64), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, server_default="unknown"),
        sa.Column("llr", sa.Float, nullable=False, server_default="0"),
        sa.Column("audited", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer, nullable=False, server_default="0"),
        sa.Column("reasons", sa.Text, nullable=False, server_default="[]"),
        sa.Column("flags", sa.Integer, nullable=False, server_default="0"),
        sa.Column("flagged_at", sa.DateTime(timezone=True)),
        sa.Column("cleared_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "audits",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_id", sa.String(200), nullable=False, index=True),
        sa.Column("worker_key", sa.String(64), nullable=False, index=True),
        sa.Column("auditor_key", sa.String(64), nullable=False),
        sa.Column("auditor_trusted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("sha256", sa.String(64)),
        sa.Column("temperature", sa.Float, nullable=False),
        sa.Column("answer_tokens", sa.Integer, nullable=False),
        sa.Column("claimed_tokens", sa.Integer, nullable=False),
        sa.Column("positions", sa.Integer, nullable=False),
        sa.Column("mismatches", sa.Integer, nullable=False),
        sa.Column("z", sa.Float, nullable=False),
        sa.Column("suspicion", sa.Float),
        sa.Column("failed", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("reason", sa.String(500), nullable=False, server_default=""),
        sa.Column("key_id", sa.Integer),
        sa.Column("charged_msat", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("refunded", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("audit_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("audit_s", sa.Float, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("audits")
    op.drop_table("audit_standings")
