"""Secrets the queen's replicas share (issue 36: the key of the callers' prompt-cache scopes).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "queen_secrets",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(128), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("queen_secrets")
