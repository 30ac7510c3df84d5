"""One diffusion model in stable-diffusion.cpp (``stable-diffusion-cpp-python``): the engine
half of image jobs (issue 38), run only inside an engine child.

``DiffusionModel(path, n_threads=...)`` checks the file again (``shared_schema.diffusion_check``:
the file may have changed since the store checked it) and loads it; ``render(order, cancelled)``
renders an ``ImageOrder``'s images, image ``i`` with seed ``order.seed + i``, each encoded as the
order says (Pillow), exactly ``width`` x ``height``.

What this build of the library does, and how it is used here:

- Renders are deterministic: the same order gives the same pixels, also across thread counts
  (checked bit for bit with 1 and 2 threads). The noise comes from sd.cpp's own Philox
  generator (``rng_type="cuda"``, computed on the CPU whatever the backend), so a GPU worker
  draws the same noise. Rendering the images one at a time gives the same pixels as one
  ``batch_count`` call (also checked), so each image is its own call.
- There is no way to stop a render inside sd.cpp: its progress callback cannot abort, and it
  has no abort callback. ``cancelled`` is looked at before each image; a render already
  running ends first (the worker ends the child when it cannot wait).
- ``verbose=False`` would point the whole process's stdout and stderr at /dev/null during every
  load and render (``dup2``, so other threads' output and sd.cpp's own errors vanish too), and
  the library's log callback maps levels backwards. Instead the model is made with
  ``verbose=True`` and sd.cpp's log and progress callbacks are replaced: warnings and errors go
  to ``logging`` (the child's stderr, which the worker logs), the rest is dropped, and the
  errors of a failed load or render are quoted in the exception.
- The binding reads ``<lora:PATH:WEIGHT>`` in a prompt and has sd.cpp open that file (any
  path, any format it parses): such a prompt is refused (``UnsupportedRequest``).
- A load sd.cpp refuses (a tensor missing, of the wrong shape) comes back from the binding as
  a model with a NULL context, whose first use or ``close`` crashes the process: it is caught
  here and raised as ``ModelLoadError`` with sd.cpp's own error lines.
- The binding's default ``eta`` (0) takes the noise out of the ancestral samplers: ``euler_a``
  rendered exactly as ``euler``. sd.cpp's own default (each sampler's, 1 for ``euler_a``) is
  asked for instead.
- The binding never frees the images sd.cpp returns (width x height x 3 bytes each, C memory):
  a long-lived child grows by that much an image.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import io
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import stable_diffusion_cpp as sd_cpp
from PIL import Image
from stable_diffusion_cpp import StableDiffusion

from desktop_worker.errors import (
    EngineError,
    GenerationCancelled,
    ModelLoadError,
    UnsupportedRequest,
)
from shared_schema.diffusion_check import DiffusionShape, read_diffusion_shape
from shared_schema.errors import InvalidDiffusionModel, NotADiffusionModel
from shared_schema.images import LORA_SYNTAX, ImageOrder, RenderedImage, image_bytes_bound

__all__ = ["DiffusionModel", "check_diffusion_model", "encode_image"]

log = logging.getLogger(__name__)

# The binding's LoRA syntax in a prompt (stable_diffusion.py, _extract_and_build_loras).
_FLUX_FAMILIES = frozenset({"flux", "flux2", "flux2_klein"})
_SD_LOG_ERROR, _SD_LOG_WARN = 3, 2
_KEPT_ERRORS = 8
_JPEG_DEFAULT_QUALITY = 100  # OpenAI's default output_compression
# sd.cpp's "each sampler's own eta" (resolve_eta): 1 for the ancestral samplers. The binding's
# default, 0, turns euler_a into euler.
_SAMPLER_DEFAULT_ETA = float("inf")


class _SdLog:
    """sd.cpp's log and progress callbacks, routed to ``logging``.

    Both are process-wide settings of the C library holding a function pointer: the ctypes
    objects behind them must outlive every later call, so one ``_SdLog`` is made per process
    (``_process_sd_log``) and never freed. While a load or a render runs, ``collect()`` gathers its
    error lines for the exception that may follow."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[str] | None = None
        self.log_callback = sd_cpp.sd_log_callback(self._on_log)
        self.progress_callback = sd_cpp.sd_progress_callback(self._on_progress)

    def install(self) -> None:
        sd_cpp.sd_set_log_callback(self.log_callback, ctypes.c_void_p(0))
        sd_cpp.sd_set_progress_callback(self.progress_callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _data: Any) -> None:
        line = text.decode("utf-8", errors="replace").rstrip()
        if level >= _SD_LOG_ERROR:
            log.error("stable-diffusion.cpp: %s", line)
            with self._lock:
                if self._errors is not None and len(self._errors) < _KEPT_ERRORS:
                    self._errors.append(line)
        elif level == _SD_LOG_WARN:
            log.warning("stable-diffusion.cpp: %s", line)

    def _on_progress(self, step: int, steps: int, seconds: float, _data: Any) -> None:
        log.debug("step %d of %d (%.2f s)", step, steps, seconds)

    @contextmanager
    def collect(self) -> Iterator[list[str]]:
        errors: list[str] = []
        with self._lock:
            self._errors = errors
        try:
            yield errors
        finally:
            with self._lock:
                self._errors = None


@functools.cache
def _process_sd_log() -> _SdLog:
    """The process's one ``_SdLog`` (see its words on why there is one)."""
    return _SdLog()


def check_diffusion_model(path: Path) -> DiffusionShape:
    """The file's shape, checked as sd.cpp needs it to load from this one file; else
    ``ModelLoadError`` saying why."""
    try:
        with path.open("rb") as handle:
            shape = read_diffusion_shape(handle, path.name)
    except InvalidDiffusionModel as exc:
        raise ModelLoadError(str(exc)) from exc
    except OSError as exc:
        raise ModelLoadError(f"{path.name} cannot be read: {exc}") from exc
    return shape


def encode_image(image: Image.Image, order: ImageOrder) -> bytes:
    """One rendered image in the order's format: PNG, or JPEG and WebP at
    ``output_compression`` (as quality; 100 when unset, OpenAI's default)."""
    rgb = image.convert("RGB")
    out = io.BytesIO()
    if order.output_format == "png":
        rgb.save(out, format="PNG")
    else:
        quality = order.output_compression
        quality = _JPEG_DEFAULT_QUALITY if quality is None else quality
        rgb.save(out, format="JPEG" if order.output_format == "jpeg" else "WEBP",
                 quality=quality)
    data = out.getvalue()
    most = image_bytes_bound(order.width, order.height)
    if len(data) > most:
        raise EngineError(f"the encoded image is {len(data):,} bytes; at most {most:,} are "
                          "delivered for its size")
    return data


class DiffusionModel:
    """A diffusion model loaded in stable-diffusion.cpp, rendering one order at a time."""

    def __init__(self, model_path: Path, *, taesd_path: Path | None = None,
                 n_threads: int) -> None:
        """``taesd_path``: a TAESD file to decode with, for a model that carries no VAE of its
        own. ``ModelLoadError`` for a file refused by the checks or by sd.cpp."""
        self.name = model_path.name
        self.shape = check_diffusion_model(model_path)
        missing = [part for part in self.shape.missing_parts
                   if not (part == "VAE" and taesd_path is not None)]
        if missing or self.shape.diffusion_only:
            raise ModelLoadError(
                f"{self.name} is a {self.shape.family} model without its "
                f"{' and '.join(missing) or 'text encoder and VAE'}: this worker loads a "
                "model from one file")
        if taesd_path is not None:
            check_diffusion_model_part(taesd_path)
        self.n_threads = n_threads
        self._busy = threading.Lock()
        self._log = _process_sd_log()
        self._log.install()
        with self._log.collect() as errors:
            try:
                self._sd = StableDiffusion(
                    model_path=str(model_path),
                    taesd_path=str(taesd_path) if taesd_path is not None else "",
                    n_threads=n_threads,
                    vae_decode_only=True,
                    rng_type="cuda",
                    sampler_rng_type="cuda",
                    verbose=True,  # see the module's words: False silences the whole process
                )
            except (ValueError, OSError) as exc:
                raise ModelLoadError(_failure(f"stable-diffusion.cpp could not load "
                                              f"{self.name}", errors, exc)) from exc
            # The binding takes sd.cpp's NULL (a failed load) for a model: its NULL pointer
            # object is not None. Its first render or its close would then crash the process.
            if not self._sd._model.model:
                self._sd._model.model = None
                raise ModelLoadError(_failure(f"stable-diffusion.cpp could not load "
                                              f"{self.name}", errors, None))
        _quiet_binding()

    def render(self, order: ImageOrder, cancelled: threading.Event | None = None
               ) -> list[RenderedImage]:
        """The order's ``n`` images in order, image ``i`` with seed ``order.seed + i``.
        ``GenerationCancelled`` when ``cancelled`` is set before an image starts."""
        if LORA_SYNTAX.search(order.prompt) or LORA_SYNTAX.search(order.negative_prompt):
            raise UnsupportedRequest("a prompt may not name a LoRA file (<lora:...>)")
        images: list[RenderedImage] = []
        with self._busy:
            for seed in order.seeds():
                if cancelled is not None and cancelled.is_set():
                    raise GenerationCancelled("the image job was cancelled")
                image = self._render_one(order, seed)
                data = encode_image(image, order)
                images.append(RenderedImage(b64_json=base64.b64encode(data).decode("ascii"),
                                            seed=seed))
        return images

    def _render_one(self, order: ImageOrder, seed: int) -> Image.Image:
        flux = self.shape.family in _FLUX_FAMILIES
        self._log.install()  # another model in this process may have made its own
        _quiet_binding()
        with self._log.collect() as errors:
            try:
                images = self._sd.generate_image(
                    prompt=order.prompt,
                    negative_prompt=order.negative_prompt,
                    width=order.width,
                    height=order.height,
                    # FLUX is guidance-distilled: the order's guidance is its distilled
                    # guidance, with classifier-free guidance off.
                    cfg_scale=1.0 if flux else order.guidance,
                    guidance=order.guidance if flux else 3.5,
                    sample_method=order.sampler,
                    sample_steps=order.steps,
                    eta=_SAMPLER_DEFAULT_ETA,
                    seed=seed,
                    batch_count=1,
                )
            except (ValueError, OSError, RuntimeError) as exc:  # a NULL result reads as
                raise EngineError(_failure("stable-diffusion.cpp could not render the "  # a
                                           "image", errors, exc)) from exc  # ValueError
        if len(images) != 1 or images[0].size != (order.width, order.height):
            raise EngineError(f"stable-diffusion.cpp answered {len(images)} image(s) of "
                              f"{images[0].size if images else None}; "
                              f"{order.width}x{order.height} was asked for")
        return images[0]

    def close(self) -> None:
        self._sd.close()

    def __enter__(self) -> DiffusionModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def check_diffusion_model_part(path: Path) -> None:
    """A TAESD file given beside a model: a readable GGUF or safetensors file (its family is
    the model's, so it is not asked for)."""
    try:
        with path.open("rb") as handle:
            read_diffusion_shape(handle, path.name)
    except NotADiffusionModel:
        return  # a lone VAE is no model: what matters is that its header is sound
    except InvalidDiffusionModel as exc:
        raise ModelLoadError(str(exc)) from exc
    except OSError as exc:
        raise ModelLoadError(f"{path.name} cannot be read: {exc}") from exc


def _quiet_binding() -> None:
    """The binding's own logger at ERROR: its ``verbose=True`` set it to DEBUG, which prints
    the system's description on stdout at every render."""
    logging.getLogger("stable-diffusion-cpp-python").setLevel(logging.ERROR)


def _failure(what: str, errors: list[str], exc: BaseException | None) -> str:
    said = "; ".join(errors) if errors else str(exc) if exc is not None else "no reason given"
    return f"{what}: {said}"
