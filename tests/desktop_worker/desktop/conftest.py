from __future__ import annotations

from tests.support.config_home import config_home  # noqa: F401 (autouse)
