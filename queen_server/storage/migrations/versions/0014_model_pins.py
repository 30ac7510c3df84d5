"""The readings hub model names are pinned to, kept across restarts and shared by replicas
(issue 39, "One reading").

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_pins",
        sa.Column("name", sa.String(512), primary_key=True),
        sa.Column("facts", sa.Text(), nullable=False),
        sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("pinned_by", sa.String(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_pins")
