"""Audits' prompt counts (issue 39): the prompt tokens the audited worker was billed for, and
the auditor's count of the prompt as the model's template renders it. Rows written before have
neither (NULL).

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-10
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("audits") as batch:
        batch.add_column(sa.Column("claimed_prompt_tokens", sa.Integer, nullable=True))
        batch.add_column(sa.Column("prompt_tokens", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audits") as batch:
        batch.drop_column("prompt_tokens")
        batch.drop_column("claimed_prompt_tokens")
