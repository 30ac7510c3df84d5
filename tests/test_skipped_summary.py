"""The README's test command ends by saying what it did not test for want of something on this
machine, and the command that brings it (``tests/support/skipped.py``)."""

from __future__ import annotations

from tests.support.skipped import missing_summary


def test_each_missing_thing_is_counted_once_with_its_command() -> None:
    lines = missing_summary([
        "Skipped: redis-server is not installed",
        "Skipped: redis-server is not installed",
        "Skipped: APIARY_TEST_POSTGRES_URL is not set (.ci/run sets it)",
        # a SQLite variant of a test of what only PostgreSQL has: nothing is missing
        "Skipped: the payout lock is PostgreSQL's (APIARY_TEST_POSTGRES_URL)",
        "Skipped: Debian's chromium is not installed at /usr/bin/chromium: run .ci/chromium.sh",
        "Skipped: POSIX signals",  # a platform's: nothing to install
    ])
    assert lines == [
        "2 tests skipped: redis-server is missing here; `bash .ci/packages.sh` brings it",
        "1 tests skipped: a PostgreSQL server is missing here; "
        "`APIARY_TEST_POSTGRES_URL=$(bash .ci/postgres.sh) python3 dev.py test` brings it",
        "1 tests skipped: Debian's chromium is missing here; `bash .ci/packages.sh` brings it",
    ]
    assert missing_summary(["Skipped: POSIX signals"]) == []
