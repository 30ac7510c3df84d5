"""Image generation (issue 38): OpenAI's ``/v1/images/generations`` as the queen honours it, the
order it gives a worker with the ``image`` capability, and what the worker delivers.

The request (``ImageGenerationRequest``) holds exactly the fields the queen honours; anything else
is refused with a 400 naming it. OpenAI's fields:

- ``prompt`` (at most ``MAX_PROMPT_CHARS``), ``model``, ``n`` (1 to ``MAX_IMAGES``);
- ``size``: ``"WxH"``, each side a multiple of ``SIDE_STEP`` from ``MIN_SIDE`` to ``MAX_SIDE``, at
  most ``MAX_PIXELS`` in all, or ``"auto"`` (``AUTO_SIDE`` square);
- ``response_format``: ``b64_json`` (the default, as gpt-image-1 answers) or ``url`` (the queen
  keeps the image for a limited time and answers a link to it);
- ``output_format`` ``png`` (default), ``jpeg`` or ``webp``, with ``output_compression`` (0-100,
  jpeg and webp only);
- ``quality``: ``auto``/``standard``/``medium`` render ``DEFAULT_STEPS`` steps, ``low`` half as
  many, ``high``/``hd`` 1.5 times, ``xhigh`` twice and ``max`` 2.5 times as many (unless ``steps``
  says how many);
- ``background``: ``auto`` or ``opaque`` (a diffusion model renders opaque images; ``transparent``
  is refused);
- ``user``: accepted, never stored; ``stream`` false only.

``style``, ``moderation``, ``partial_images``, ``complexity``, ``frame_count``,
``frame_duration_ms``, ``svg`` and ``stream: true`` are refused: the queen does not honour them
(``shared_schema.openai_fields.IMAGES`` says why). Diffusion settings OpenAI lacks are Apiary's
documented extra fields (the openai SDK sends them with ``extra_body``): ``seed`` (the first
image's; image ``i`` uses ``seed + i``; the queen draws one when it is left out and answers it in
``apiary.seed``), ``steps``, ``negative_prompt``, ``guidance`` (classifier-free guidance scale) and
``sampler``.

To the worker an image job is an ordinary ``Job`` whose ``openai_url`` is ``IMAGES_URL`` and whose
``openai_req`` is an ``ImageOrder``: every setting resolved by the queen (seed included), so that
an audit renders the same order again. It ends with a ``Result`` whose ``data`` is an
``ImagesResult`` (each image encoded as the order says) and whose usage the queen ignores: an image
is billed by the queen's own count (``megapixel_steps``), never a claim.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from shared_schema.base import WireModel

IMAGES_URL = "/v1/images/generations"
# The prefix of the size classes image models' speed records are kept under on the queen, so
# that seconds per image token (a hundredth of a megapixel-step by default) never mix with a text
# class's seconds per token.
IMAGE_CLASS = "image:"
IMAGE_ORDER = "apiary.image_order"
IMAGES_RESULT = "apiary.images_result"

MAX_IMAGES = 4
MAX_PROMPT_CHARS = 4000
MIN_SIDE = 64
MAX_SIDE = 2048
SIDE_STEP = 64
MAX_PIXELS = 2048 * 1024
MAX_STEPS = 100
DEFAULT_STEPS = 20
AUTO_SIDE = 512
MAX_GUIDANCE = 30.0
MAX_SEED = 2**32 - 1
# One order's images in all (n times the size): their worst-case encoding (3 bytes a pixel, as a
# PNG of noise takes) in base64 fits one 16 MiB frame (the queen's max_frame_bytes).
MAX_ORDER_PIXELS = 3 * 2**20
# What an encoded image may take beyond 3 bytes a pixel (PNG's row filters and chunks, a WebP
# or JPEG header).
IMAGE_BYTES_SLACK = 64 * 1024

OutputFormat = Literal["png", "jpeg", "webp"]
Quality = Literal["auto", "standard", "low", "medium", "high", "hd", "xhigh", "max"]
# Steps per quality, as a multiple of DEFAULT_STEPS.
_QUALITY_STEPS = {"low": 0.5, "high": 1.5, "hd": 1.5, "xhigh": 2.0, "max": 2.5}
# stable-diffusion.cpp's samplers that every model family runs.
Sampler = Literal["euler", "euler_a", "heun", "dpm2", "dpm++2m", "dpm++2mv2", "lcm"]
ImageSeed = Annotated[int, Field(ge=0, le=MAX_SEED)]

_SIZE = re.compile(r"^([1-9][0-9]{1,4})x([1-9][0-9]{1,4})$")
# stable-diffusion.cpp reads "<lora:PATH:weight>" in a prompt as a LoRA file to open: refused in
# requests here and again by the worker's engine (``desktop_worker.engine.diffusion``).
LORA_SYNTAX = re.compile(r"<\s*lora\s*:", re.IGNORECASE)


def _refuse_lora(value: str | None) -> str | None:
    if value is not None and LORA_SYNTAX.search(value):
        raise ValueError("a prompt may not name a LoRA file (<lora:...>): stable-diffusion.cpp "
                         "would open that path on the worker")
    return value


def parse_size(size: str) -> tuple[int, int]:
    """``(width, height)`` of a ``"WxH"`` size (``"auto"``: ``AUTO_SIDE`` square); ``ValueError``
    (in plain words) for anything the queen does not render."""
    if size == "auto":
        return AUTO_SIDE, AUTO_SIDE
    found = _SIZE.fullmatch(size)
    if found is None:
        raise ValueError(f"{size!r} is not a size: use \"WIDTHxHEIGHT\" (for example "
                         "\"512x512\") or \"auto\"")
    width, height = int(found.group(1)), int(found.group(2))
    for side in (width, height):
        if not MIN_SIDE <= side <= MAX_SIDE or side % SIDE_STEP:
            raise ValueError(f"each side of {size} must be a multiple of {SIDE_STEP} from "
                             f"{MIN_SIDE} to {MAX_SIDE}")
    if width * height > MAX_PIXELS:
        raise ValueError(f"{size} is {width * height:,} pixels; at most {MAX_PIXELS:,} are "
                         "rendered")
    return width, height


def steps_for(quality: Quality, steps: int | None) -> int:
    """The steps an image is rendered with: ``steps`` when asked, else by ``quality``."""
    if steps is not None:
        return steps
    return round(DEFAULT_STEPS * _QUALITY_STEPS.get(quality, 1.0))


def image_bytes_bound(width: int, height: int) -> int:
    """The most bytes one encoded image of this size may take (a worker's larger one is
    refused): 3 bytes a pixel, one filter byte a row, and ``IMAGE_BYTES_SLACK``."""
    return width * height * 3 + height + IMAGE_BYTES_SLACK


def result_chars_bound(order: dict[str, Any]) -> int:
    """The most characters a worker's ``Result`` frame for an ``ImageOrder`` (as a dict) may
    take: each image's bound in base64, and room for the envelope."""
    width, height, n = order.get("width"), order.get("height"), order.get("n")
    if not all(isinstance(value, int) for value in (width, height, n)):
        return IMAGE_BYTES_SLACK
    return n * (4 * image_bytes_bound(width, height) // 3 + 1024) + IMAGE_BYTES_SLACK  # type: ignore[operator]


# stable-diffusion.cpp's compute buffers beside the weights: a 1024x1024 SDXL render on the CPU
# takes about 1.5 GB, the SDXS test model's 512x512 about 560 MB (bench/RESULTS.md); the
# allowance covers them with room. The worker's image child is confined to this beside its
# files (``desktop_worker.sandbox.images``), and placement asks an image worker for as much.
IMAGE_COMPUTE_MB = 3072


def diffusion_memory_mb(size_bytes: int) -> int:
    """The memory a worker's image engine is allowed to serve a diffusion model file of
    ``size_bytes`` (its weights and ``IMAGE_COMPUTE_MB``): what on-demand placement asks of an
    image worker's memory budget."""
    return -(-size_bytes // 2**20) + IMAGE_COMPUTE_MB


def megapixel_steps(width: int, height: int, steps: int, n: int = 1) -> float:
    """The work of ``n`` images: megapixels times steps, the unit images are priced and timed
    in."""
    return width * height / 1_000_000 * steps * n


class ImageGenerationRequest(WireModel):
    """``POST /v1/images/generations``: OpenAI's fields the queen honours and Apiary's extras."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str = Field(min_length=1, max_length=512)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    quality: Quality = "auto"
    background: Literal["auto", "opaque"] = "auto"
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    stream: Literal[False] = False
    # Apiary's extras (``extra_body``).
    seed: ImageSeed | None = None
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    guidance: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE)
    sampler: Sampler | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, value: str) -> str:
        parse_size(value)
        return value

    _no_lora = field_validator("prompt", "negative_prompt")(
        classmethod(lambda cls, value: _refuse_lora(value)))

    @model_validator(mode="after")
    def _compression(self) -> ImageGenerationRequest:
        if self.output_compression is not None and self.output_format == "png":
            raise ValueError("output_compression applies to jpeg and webp only")
        width, height = parse_size(self.size)
        if self.n * width * height > MAX_ORDER_PIXELS:
            raise ValueError(f"{self.n} images of {width}x{height} are "
                             f"{self.n * width * height:,} pixels; one request renders at most "
                             f"{MAX_ORDER_PIXELS:,} (ask for fewer or smaller images)")
        return self


class ImageOrder(WireModel):
    """An image job as the worker renders it: every setting resolved by the queen."""

    type: Literal["apiary.image_order"] = IMAGE_ORDER
    model: str = Field(min_length=1, max_length=512)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    width: int = Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_STEP)
    height: int = Field(ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIDE_STEP)
    steps: int = Field(ge=1, le=MAX_STEPS)
    guidance: float = Field(ge=0, le=MAX_GUIDANCE)
    sampler: Sampler
    seed: ImageSeed
    n: int = Field(ge=1, le=MAX_IMAGES)
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)

    @model_validator(mode="after")
    def _bounded(self) -> ImageOrder:
        if self.width * self.height > MAX_PIXELS:
            raise ValueError(f"at most {MAX_PIXELS:,} pixels are rendered")
        if self.n * self.width * self.height > MAX_ORDER_PIXELS:
            raise ValueError(f"at most {MAX_ORDER_PIXELS:,} pixels are rendered in one order")
        if self.seed + self.n - 1 > MAX_SEED:
            raise ValueError("the last image's seed would pass 2**32 - 1")
        return self

    _no_lora = field_validator("prompt", "negative_prompt")(
        classmethod(lambda cls, value: _refuse_lora(value)))

    def seeds(self) -> list[int]:
        """Each image's seed, in order."""
        return [self.seed + i for i in range(self.n)]


class RenderedImage(WireModel):
    """One image a worker rendered, encoded as its order's ``output_format``."""

    b64_json: str = Field(min_length=1,
                          max_length=4 * image_bytes_bound(MAX_SIDE, MAX_SIDE) // 3 + 4)
    seed: ImageSeed


class ImagesResult(WireModel):
    """A worker's answer to an ``ImageOrder``: ``n`` images, in order (``Result.data``)."""

    type: Literal["apiary.images_result"] = IMAGES_RESULT
    images: list[RenderedImage] = Field(min_length=1, max_length=MAX_IMAGES)
    render_s: float = Field(default=0.0, ge=0, le=86_400)  # a claim: shown, never billed
