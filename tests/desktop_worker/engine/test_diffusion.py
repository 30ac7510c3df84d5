"""The diffusion engine (``engine/diffusion.py``) on the real stable-diffusion.cpp, with the
random-weight SDXS model the tests write (``tests/support/diffusion_models.py``): images of the
asked size and format, one seed an image, the same order the same pixels (across thread counts
too), another seed, prompt or model another image; and what it refuses: a prompt naming a LoRA
file, a cancelled job, a file sd.cpp would not load (without crashing the process), a file the
checks refuse before sd.cpp sees it."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from desktop_worker.engine.diffusion import DiffusionModel
from desktop_worker.errors import GenerationCancelled, ModelLoadError, UnsupportedRequest
from shared_schema.images import ImageOrder, RenderedImage
from tests.support.diffusion_fixture import (  # noqa: F401  (fixtures)
    diffusion_model,
    other_diffusion_model,
)
from tests.support.diffusion_models import WrittenModel, write_sdxs_model, write_taesd
from tests.support.gguf_mutants import gguf_bytes

ORDER = ImageOrder(model="test/sdxs", prompt="a lighthouse at dusk", width=64, height=64,
                   steps=2, guidance=7.0, sampler="euler", seed=1234, n=1)


@pytest.fixture(scope="module")
def model(diffusion_model: WrittenModel) -> DiffusionModel:  # noqa: F811
    with DiffusionModel(diffusion_model.path, n_threads=2) as loaded:
        yield loaded


def pixels(image: RenderedImage) -> tuple[str | None, np.ndarray]:
    picture = Image.open(io.BytesIO(base64.b64decode(image.b64_json)))
    return picture.format, np.asarray(picture.convert("RGB")).astype(np.int16)


def render(model: DiffusionModel, **changes: object) -> list[RenderedImage]:
    return model.render(ORDER.model_copy(update=changes))


def test_a_png_of_the_asked_size_that_is_a_picture(model: DiffusionModel) -> None:
    [image] = render(model)
    kind, rgb = pixels(image)
    assert kind == "PNG"
    assert rgb.shape == (64, 64, 3)
    assert image.seed == 1234
    assert rgb.std() > 20, "a constant colour is no render"
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 500
    [wide] = render(model, width=128, height=64)
    assert pixels(wide)[1].shape == (64, 128, 3)


def test_n2_renders_seeds_s_and_s_plus_1_each_as_alone(model: DiffusionModel) -> None:
    first, second = render(model, n=2)
    assert (first.seed, second.seed) == (1234, 1235)
    a, b = pixels(first)[1], pixels(second)[1]
    assert np.abs(a - b).mean() > 10
    [alone] = render(model, seed=1235)
    assert np.array_equal(pixels(alone)[1], b)
    assert alone.b64_json == second.b64_json  # the same PNG bytes too


def test_the_same_order_renders_the_same_pixels(model: DiffusionModel) -> None:
    once, again = render(model), render(model)
    assert once[0].b64_json == again[0].b64_json


@pytest.mark.parametrize("change", [{"seed": 99}, {"prompt": "a red bicycle"},
                                    {"negative_prompt": "blurry"}, {"steps": 3},
                                    {"guidance": 2.0}, {"sampler": "heun"}])
def test_another_setting_renders_another_image(model: DiffusionModel,
                                               change: dict[str, object]) -> None:
    base = pixels(render(model)[0])[1]
    other = pixels(render(model, **change)[0])[1]
    assert np.abs(base - other).mean() > 2, f"{change} changed nothing"


def test_euler_a_adds_its_noise(model: DiffusionModel) -> None:
    """The binding's default eta (0) would render euler_a exactly as euler."""
    euler = pixels(render(model, steps=4)[0])[1]
    ancestral = pixels(render(model, steps=4, sampler="euler_a")[0])[1]
    assert np.abs(euler - ancestral).mean() > 5


def test_one_and_two_threads_render_the_same_pixels(diffusion_model: WrittenModel,  # noqa: F811
                                                    model: DiffusionModel) -> None:
    with DiffusionModel(diffusion_model.path, n_threads=1) as single:
        assert single.render(ORDER)[0].b64_json == model.render(ORDER)[0].b64_json


def test_another_model_renders_another_image(other_diffusion_model: WrittenModel,  # noqa: F811
                                             model: DiffusionModel) -> None:
    with DiffusionModel(other_diffusion_model.path, n_threads=2) as other:
        assert other.shape.family == model.shape.family == "sdxs"
        theirs = pixels(other.render(ORDER)[0])[1]
    ours = pixels(model.render(ORDER)[0])[1]
    assert np.abs(theirs - ours).mean() > 10


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_jpeg_and_webp_at_the_asked_quality(model: DiffusionModel, fmt: str) -> None:
    fine = render(model, output_format=fmt, output_compression=95)[0]
    coarse = render(model, output_format=fmt, output_compression=10)[0]
    kind, rgb = pixels(fine)
    assert kind == fmt.upper()
    assert rgb.shape == (64, 64, 3)
    assert len(coarse.b64_json) < len(fine.b64_json)
    png = pixels(render(model)[0])[1]
    assert np.abs(rgb - png).mean() < 25  # the same picture, lossy


def test_a_prompt_naming_a_lora_file_is_refused(model: DiffusionModel, tmp_path: Path) -> None:
    """The binding would have sd.cpp open any file a prompt names as a LoRA."""
    bait = tmp_path / "bait.safetensors"
    bait.write_bytes(b"\x00" * 64)
    with pytest.raises(UnsupportedRequest, match="LoRA"):
        render(model, prompt=f"a cat <lora:{bait}:1.0>")


def test_a_cancelled_job_stops_before_its_next_image(model: DiffusionModel) -> None:
    class CancelAfterFirst(threading.Event):
        """Set once the first image has started (the second look)."""

        def __init__(self) -> None:
            super().__init__()
            self.looks = 0

        def is_set(self) -> bool:
            self.looks += 1
            return self.looks > 1

    cancel = CancelAfterFirst()
    with pytest.raises(GenerationCancelled):
        model.render(ORDER.model_copy(update={"n": 3}), cancel)
    assert cancel.looks == 2  # the first image rendered, the second never started
    stopped = threading.Event()
    stopped.set()
    with pytest.raises(GenerationCancelled):
        model.render(ORDER, stopped)


def _sdxs_header_only(path: Path, *, vae: bool = True) -> Path:
    """A small GGUF whose few tensors make sd.cpp read it as SDXS, the rest missing."""
    tensors = [
        ("model.diffusion_model.input_blocks.0.0.weight", (3, 3, 4, 320), 1, 0),
        ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
         (768, 4), 0, 23040),
    ]
    if vae:
        tensors.append(("first_stage_model.decoder.layers.0.bias", (64,), 0, 23040 + 12288))
    path.write_bytes(gguf_bytes([], tensors, 23040 + 12288 + 256))
    return path


def test_a_model_sd_cpp_refuses_fails_the_load_and_the_process_goes_on(
        tmp_path: Path, model: DiffusionModel) -> None:
    """sd.cpp's failed load reaches the binding as a model with a NULL context, whose close
    would crash this process: the error quotes sd.cpp and the process renders on."""
    path = _sdxs_header_only(tmp_path / "partial.gguf")
    with pytest.raises(ModelLoadError, match=r"could not load partial.gguf: .*(has wrong shape "
                                             r"|not in model file)"):
        DiffusionModel(path, n_threads=2)
    assert render(model)[0].seed == ORDER.seed


def test_a_file_the_checks_refuse_never_reaches_sd_cpp(tmp_path: Path,
                                                       diffusion_model: WrittenModel  # noqa: F811
                                                       ) -> None:
    cut = tmp_path / "cut.gguf"
    with diffusion_model.path.open("rb") as handle:
        cut.write_bytes(handle.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated"):
        DiffusionModel(cut, n_threads=2)
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"\x80\x02}q\x00(X\x05\x00\x00\x00model" + bytes(64))
    with pytest.raises(ModelLoadError, match="safetensors"):
        DiffusionModel(pickle, n_threads=2)
    with pytest.raises(ModelLoadError, match="without its VAE"):
        DiffusionModel(_sdxs_header_only(tmp_path / "novae.gguf", vae=False), n_threads=2)


def test_a_model_without_its_vae_renders_with_a_taesd_file_beside_it(
        tmp_path: Path, model: DiffusionModel) -> None:
    """sd.cpp decodes SDXS with TAESD, from the model file or from ``taesd_path``: the model's
    own decoder as a file of its own renders the very same pixels."""
    bare = write_sdxs_model(tmp_path / "no-vae.gguf", leave_out=frozenset({"first_stage_model."}))
    taesd = write_taesd(tmp_path / "taesd.gguf")
    try:
        with pytest.raises(ModelLoadError, match="without its VAE"):
            DiffusionModel(bare.path, n_threads=2)
        with DiffusionModel(bare.path, taesd_path=taesd.path, n_threads=2) as split:
            assert split.render(ORDER)[0].b64_json == model.render(ORDER)[0].b64_json
        (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
        with pytest.raises(ModelLoadError, match="GGUF"):
            DiffusionModel(bare.path, taesd_path=tmp_path / "junk.gguf", n_threads=2)
    finally:
        bare.path.unlink()
