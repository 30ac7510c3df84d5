"""The store's index file: one JSON document, replaced atomically on every write."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["INDEX_VERSION", "IndexFile"]

logger = logging.getLogger(__name__)

INDEX_VERSION = 1


class IndexFile:
    """Reads and writes ``{"version": 1, "models": {name: record}}`` at ``path``.

    A write goes to a temporary file in the same folder, is flushed to disk, then replaces the
    index in one step, so a crash leaves the old index or the new one, never half of one. Callers
    serialize writes (``ModelStore`` holds a lock).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, dict[str, Any]]:
        """The records by name; an unreadable index is set aside (``.corrupt-<time>``)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            models = data["models"]
            if not isinstance(models, dict):
                raise TypeError("models is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            logger.error("model index %s is unreadable (%s); moved to %s", self.path, exc, aside)
            os.replace(self.path, aside)
            return {}
        if data.get("version") != INDEX_VERSION:
            logger.warning("index version %r, expected %d", data.get("version"), INDEX_VERSION)
        return {str(k): v for k, v in models.items() if isinstance(v, dict)}

    def save(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the index with ``records``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        document = {"version": INDEX_VERSION, "models": dict(sorted(records.items()))}
        fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
