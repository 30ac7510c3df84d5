"""Fine-tuned models served (issue 37): when its owner deleted a job's model (it is then no
longer listed or served), and an index to find a job by its model's name.

Revision ID: 0013
Revises: 0012
Create Date: 2027-02-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.add_column(sa.Column("model_deleted_at", sa.DateTime(timezone=True),
                                   nullable=True))
        batch.create_index("ix_fine_tuning_jobs_fine_tuned_model", ["fine_tuned_model"])


def downgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_index("ix_fine_tuning_jobs_fine_tuned_model")
        batch.drop_column("model_deleted_at")
