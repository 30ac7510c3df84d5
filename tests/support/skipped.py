"""The last lines of a test run that skipped tests for want of something this machine lacks:
how many, for what, and the one command that brings it (issue 40: a contributor running the
README's test command should learn what it did not test, and how to test it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["missing_summary"]

# (a phrase of the skip's reason, what is missing, the command that brings it)
MISSING = (
    ("redis-server", "redis-server", "bash .ci/packages.sh"),
    ("chromium", "Debian's chromium", "bash .ci/packages.sh"),
    # (not a test's SQLite variant skipping what only PostgreSQL has: "... (APIARY_TEST_...)")
    ("APIARY_TEST_POSTGRES_URL is not set", "a PostgreSQL server",
     "APIARY_TEST_POSTGRES_URL=$(bash .ci/postgres.sh) python3 dev.py test"),
    ("docker compose plugin", "the docker compose plugin", "apt-get install docker-compose"),
    ("built and run only when asked", "Docker, for the compose stack test,",
     "APIARY_TEST_COMPOSE=1 python3 dev.py test tests/deploy/test_compose_up.py"),
    ("no Docker daemon", "a Docker daemon", "bash .ci/docker.sh"),
    ("LNbits is not installed", "LNbits", "python3 -m tests.support.lnbits_server install"),
)


def missing_summary(reasons: Iterable[str]) -> list[str]:
    """One line per missing thing that skipped tests, and the command that brings it."""
    counts: Counter[tuple[str, str]] = Counter()
    for reason in reasons:
        for phrase, what, command in MISSING:
            if phrase.lower() in reason.lower():
                counts[(what, command)] += 1
                break
    return [f"{count} tests skipped: {what} is missing here; `{command}` brings it"
            for (what, command), count in counts.most_common()]
