"""Files (issue 37): what the Files API keeps of each upload: its owner (a key, a development
key's hash, or the open caller), name, purpose, size, examples, sha256 and where its bytes are;
a deleted file keeps its row, marked.

Revision ID: 0010
Revises: 0009
Create Date: 2027-01-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("examples", sa.Integer, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("location", sa.String(1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_files_owner_seq", "files", ["owner", "seq"])


def downgrade() -> None:
    op.drop_index("ix_files_owner_seq", table_name="files")
    op.drop_table("files")
