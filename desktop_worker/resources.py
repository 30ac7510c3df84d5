"""Finding the files in the project's ``resources/`` folder, from source and when frozen.

PyInstaller unpacks the app's data next to its modules and sets ``sys._MEIPASS`` to that folder;
the installers bundle ``resources/`` there under the same name. From a source checkout (and an
editable install) the folder is the one at the repository root. ``APIARY_RESOURCES_DIR``
overrides both.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from desktop_worker.errors import WorkerError

__all__ = ["ResourceMissing", "resource_path", "resources_dir"]


class ResourceMissing(WorkerError):
    """A file the app ships with is not where it should be (a broken install)."""


def resources_dir() -> Path:
    override = os.environ.get("APIARY_RESOURCES_DIR")
    if override:
        return Path(override)
    frozen = getattr(sys, "_MEIPASS", None)
    if frozen:
        return Path(frozen) / "resources"
    return Path(__file__).resolve().parents[1] / "resources"


def resource_path(*parts: str) -> Path:
    """The path of ``resources/<parts...>``; raises ``ResourceMissing`` if it is not there."""
    path = resources_dir().joinpath(*parts)
    if not path.exists():
        raise ResourceMissing(f"{'/'.join(parts)} is missing from {resources_dir()}; "
                              "the installation looks incomplete")
    return path
