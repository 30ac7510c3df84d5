"""Job charges (issue 39): what each settled job was billed, and at what rates, written with its
settle posting, so that an audit's exact counts can re-price the job (``Billing.rebill``). Jobs
settled before have no row (they cannot be rebilled; a refund still works from the ledger).

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-12
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_charges",
        sa.Column("job_id", sa.String(200), primary_key=True),
        sa.Column("key_id", sa.Integer, nullable=False),
        sa.Column("size_class", sa.String(32), nullable=False),
        sa.Column("prompt_msat_per_1k", sa.BigInteger, nullable=False),
        sa.Column("completion_msat_per_1k", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("charge_msat", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_charges")
