from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
os.environ.setdefault("no_proxy", "127.0.0.1,localhost")
# Qt must have a platform before it is imported, or it aborts the process with no display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# No test reads or writes the developer's real settings.json, key file or keyring.
os.environ.setdefault("APIARY_CONFIG_DIR", tempfile.mkdtemp(prefix="apiary-test-config-"))
os.environ.setdefault("PYTHON_KEYRING_BACKEND", "keyring.backends.fail.Keyring")
# Replicas seal their bus's messages with a shared secret, required with APIARY_REDIS_URL (issue
# 40): every queen the tests start, in this process or another, shares this one. The tests of
# the requirement remove it (tests/queen_server/cluster/test_seal.py).
os.environ.setdefault("APIARY_CLUSTER_SECRET", "apiary-tests-cluster-secret")

# Workers in tests keep 1 GB of the disk free, whatever this machine's disk holds (see there).
from tests.support.disk_headroom import (
    HEADROOM_ENV,
    TEST_HEADROOM_GB,
    real_disk_headroom,  # noqa: F401  (autouse)
)

os.environ.setdefault(HEADROOM_ENV, TEST_HEADROOM_GB)

from tests.support.queen import QueenHarness, running_queen
from tests.support.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.support.skipped import missing_summary


@pytest.fixture
async def queen(tmp_path: Path) -> AsyncIterator[QueenHarness]:
    async with running_queen(tmp_path) as harness:
        yield harness


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    """Keep the reasons of the skipped tests, for ``pytest_unconfigure``'s last lines."""
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reasons.append(str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr))
    config.stash[SKIP_REASONS] = reasons


def pytest_unconfigure(config: pytest.Config) -> None:
    """The very last lines: the tests skipped for something this machine lacks, and the one
    command that brings each."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    for line in missing_summary(config.stash.get(SKIP_REASONS, [])):
        reporter.write_line(line, yellow=True)


SKIP_REASONS = pytest.StashKey[list[str]]()
