"""Diffusion models in the model store (issue 38): pulled from the hub by name like an LLM (the
real huggingface_hub client against the fake hub), imported from a file, checked whole, kept
with their family and parameter count, and announced as ``kind`` "image"; a diffusion file
without its text encoder and VAE, and a file that is no model at all, are refused and leave
nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store import ModelStore
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.diffusion_models import WrittenModel, write_sdxs_model
from tests.support.fake_hub import FakeHub, FakeRepo

REPO = "org/tiny-sd-GGUF"
FILE = "sdxs-512-ds-Q4_0.gguf"


def test_a_hub_diffusion_model_is_pulled_by_name_and_announced_as_an_image_model(
        tmp_path, diffusion_model) -> None:  # noqa: F811
    model: WrittenModel = diffusion_model
    with FakeHub([FakeRepo(REPO, {FILE: model.path})]) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        pulled = store.pull(f"{REPO}:Q4_0")
    assert pulled.sha256 == model.sha256
    assert pulled.info.is_diffusion
    assert pulled.info.architecture == "diffusion:sdxs"
    assert pulled.info.parameter_count == model.parameter_count
    [announced] = store.descriptors()
    assert announced.kind == "image"
    assert announced.parameter_count == model.parameter_count
    assert announced.context_length is None


def test_an_imported_diffusion_file_is_kept_and_a_partless_one_refused(
        tmp_path, diffusion_model) -> None:  # noqa: F811
    store = ModelStore(tmp_path / "models")
    kept = store.import_file(diffusion_model.path, "my-sd")
    assert kept.info.is_diffusion
    assert store.descriptors()[0].kind == "image"
    partless = tmp_path / "unet-only.gguf"  # no text encoder: nothing renders from it alone
    write_sdxs_model(partless, leave_out=frozenset({"cond_stage_model."}))
    with pytest.raises(InvalidModelFile):
        store.import_file(partless, "unet-only")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(8192))
    with pytest.raises(InvalidModelFile):
        store.import_file(garbage, "garbage")
    assert [model.name for model in store.list()] == ["my-sd"]
    assert sorted(p.name for p in Path(tmp_path / "models").rglob("*.gguf")) == [
        diffusion_model.path.name]
