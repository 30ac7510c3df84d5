"""A fresh worker config dir per test, with no ``APIARY_*`` setting leaking in from the shell.

Conftests that want it for every test import the fixture: ``from tests.support.config_home
import config_home``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.disk_headroom import HEADROOM_ENV, TEST_HEADROOM_GB


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh config dir per test, and no ``APIARY_*`` setting leaking in from the shell but
    the test run's disk headroom (``tests.support.disk_headroom``)."""
    for name in list(os.environ):
        if name.startswith("APIARY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(HEADROOM_ENV, TEST_HEADROOM_GB)
    home = tmp_path / "config"
    monkeypatch.setenv("APIARY_CONFIG_DIR", str(home))
    return home
