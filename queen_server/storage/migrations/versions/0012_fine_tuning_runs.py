"""Fine-tuning jobs on workers (issue 37): each job's current attempt, the worker's upload
bound and the adapter it delivered; each checkpoint's hash, size and trained tokens; the
uploads the queen received and hashed itself.

Revision ID: 0012
Revises: 0011
Create Date: 2027-01-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("upload_limit_bytes", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("adapter_location", sa.String(1024), nullable=True))
        batch.add_column(sa.Column("adapter_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("adapter_size_bytes", sa.BigInteger, nullable=True))
    with op.batch_alter_table("fine_tuning_checkpoints") as batch:
        batch.add_column(sa.Column("sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("size_bytes", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("trained_tokens", sa.BigInteger, nullable=True))
    op.create_table(
        "fine_tuning_uploads",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), nullable=False, index=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("name", sa.String(80), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("job_id", "attempt", "name", name="uq_fine_tuning_uploads_name"),
    )


def downgrade() -> None:
    op.drop_table("fine_tuning_uploads")
    with op.batch_alter_table("fine_tuning_checkpoints") as batch:
        batch.drop_column("trained_tokens")
        batch.drop_column("size_bytes")
        batch.drop_column("sha256")
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("adapter_size_bytes")
        batch.drop_column("adapter_sha256")
        batch.drop_column("adapter_location")
        batch.drop_column("upload_limit_bytes")
        batch.drop_column("attempt")
