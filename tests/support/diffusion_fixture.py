"""Session fixtures of the random-weight diffusion models (``diffusion_models.py``): each file is
written once per test session, under pytest's base temporary folder, and shared read-only.
Several conftests may import the fixtures (pytest then holds one copy of each per conftest): the
file is written by the first and found on disk by the others (``cached_sdxs_model``).

A test package that needs them imports the fixtures into its ``conftest.py``::

    from tests.support.diffusion_fixture import diffusion_model, other_diffusion_model  # noqa: F401

``diffusion_model`` is the SDXS-512-DS model of seed 0, ``other_diffusion_model`` the same shape
with the weights of seed 1 (an "other model" for the audits), ``safetensors_diffusion_model``
the model of seed 0 as a single-file safetensors checkpoint (880 MB, written in about 7 s).
Each is a ``WrittenModel``: its ``path``, ``sha256``, ``size_bytes`` and ``parameter_count``.
Writing a GGUF one takes about 4 s and 500 MB of disk. Do not change the files: copy one to
make a mutant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.diffusion_models import (
    WrittenModel,
    write_sdxs_model,
    write_sdxs_safetensors,
)

__all__ = ["cached_sdxs_model", "diffusion_model", "other_diffusion_model",
           "safetensors_diffusion_model"]


def cached_sdxs_model(folder: Path, seed: int, suffix: str = ".gguf") -> WrittenModel:
    """The model of ``seed`` in ``folder`` (a ``.gguf``, or a ``.safetensors`` file): written
    once, with a note of its facts beside it (written last, so a note means a whole file)."""
    path = folder / f"sdxs-512-ds-random-seed{seed}{suffix}"
    note = path.with_suffix(".json" if suffix == ".gguf" else suffix + ".json")
    if note.exists():
        facts = json.loads(note.read_text())
        return WrittenModel(path=path, sha256=facts["sha256"], size_bytes=facts["size_bytes"],
                            parameter_count=facts["parameter_count"])
    writer = write_sdxs_model if suffix == ".gguf" else write_sdxs_safetensors
    model = writer(path, seed=seed)
    note.write_text(json.dumps({"sha256": model.sha256, "size_bytes": model.size_bytes,
                                "parameter_count": model.parameter_count}))
    return model


def _model(tmp_path_factory: pytest.TempPathFactory, seed: int) -> WrittenModel:
    return cached_sdxs_model(tmp_path_factory.getbasetemp() / "diffusion-models", seed)


@pytest.fixture(scope="session")
def diffusion_model(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    """The test diffusion model (SDXS-512-DS shaped, random weights of seed 0)."""
    return _model(tmp_path_factory, 0)


@pytest.fixture(scope="session")
def other_diffusion_model(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    """Another model of the same shape: the weights of seed 1."""
    return _model(tmp_path_factory, 1)


@pytest.fixture(scope="session")
def safetensors_diffusion_model(tmp_path_factory: pytest.TempPathFactory) -> WrittenModel:
    """The test diffusion model of seed 0 as a single-file safetensors checkpoint."""
    return cached_sdxs_model(tmp_path_factory.getbasetemp() / "diffusion-models", 0,
                             ".safetensors")
