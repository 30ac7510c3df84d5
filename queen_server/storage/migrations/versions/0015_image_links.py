"""The images of url answers, kept for a limited time (issue 38).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "image_links",
        sa.Column("token", sa.String(64), primary_key=True),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("output_format", sa.String(8), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_image_links_expires_at", "image_links", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_image_links_expires_at", table_name="image_links")
    op.drop_table("image_links")
