"""Persisted worker performance: counters on workers, and speeds per model size class.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("jobs_served", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("failures", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("timeouts", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("uptime_s", sa.Float, nullable=False, server_default="0"))
    op.create_table(
        "worker_speeds",
        sa.Column("worker_key", sa.String(64), primary_key=True),
        sa.Column("size_class", sa.String(32), primary_key=True),
        sa.Column("prompt_s_per_token", sa.Float),
        sa.Column("completion_s_per_token", sa.Float),
        sa.Column("samples", sa.Integer, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("worker_speeds")
    with op.batch_alter_table("workers") as batch:
        for column in ("uptime_s", "timeouts", "failures", "jobs_served"):
            batch.drop_column(column)
