"""Count each worker's settled jobs, for escrow (proof of work, then pending earnings).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("jobs_settled", sa.Integer, nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("jobs_settled")
