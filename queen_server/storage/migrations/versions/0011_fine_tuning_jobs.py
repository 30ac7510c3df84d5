"""Fine-tuning jobs (issue 37): the jobs, their events and their checkpoints.

Revision ID: 0011
Revises: 0010
Create Date: 2027-01-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("owner", sa.String(128), nullable=False, index=True),
        sa.Column("key_id", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("training_file", sa.String(128), nullable=False),
        sa.Column("validation_file", sa.String(128), nullable=True),
        sa.Column("suffix", sa.String(64), nullable=True),
        sa.Column("seed", sa.Integer, nullable=False),
        sa.Column("n_epochs", sa.Integer, nullable=False),
        sa.Column("batch_size", sa.Integer, nullable=False),
        sa.Column("learning_rate_multiplier", sa.Float, nullable=False),
        sa.Column("status", sa.String(20), nullable=False, index=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.String(1000), nullable=True),
        sa.Column("error_param", sa.String(64), nullable=True),
        sa.Column("fine_tuned_model", sa.String(700), nullable=True),
        sa.Column("bound_tokens", sa.BigInteger, nullable=False),
        sa.Column("trained_tokens", sa.BigInteger, nullable=True),
        sa.Column("held_msat", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("charged_msat", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("estimated_finish", sa.DateTime(timezone=True), nullable=True),
        sa.Column("metadata_json", sa.String(20_000), nullable=True),
        sa.Column("worker_key", sa.String(64), nullable=True),
    )
    op.create_table(
        "fine_tuning_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), nullable=False, index=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("level", sa.String(8), nullable=False),
        sa.Column("type", sa.String(8), nullable=False),
        sa.Column("message", sa.String(2000), nullable=False),
        sa.Column("data_json", sa.String(4000), nullable=True),
    )
    op.create_table(
        "fine_tuning_checkpoints",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), nullable=False, index=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("train_loss", sa.Float, nullable=True),
        sa.Column("valid_loss", sa.Float, nullable=True),
        sa.Column("location", sa.String(1000), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fine_tuning_checkpoints")
    op.drop_table("fine_tuning_events")
    op.drop_table("fine_tuning_jobs")
