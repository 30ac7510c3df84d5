"""Auditors outvoted (issue 39): how often a second opinion contradicted a worker's failing
verdict as an auditor. Past ``audits.independence.OUTVOTED_LIMIT`` it audits no one. Rows
written before start at 0.

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-11
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audit_standings") as batch:
        batch.add_column(sa.Column("outvoted", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("audit_standings") as batch:
        batch.drop_column("outvoted")
