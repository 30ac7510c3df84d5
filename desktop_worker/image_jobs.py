"""Image jobs on the worker (issue 38): the queen's ``ImageOrder`` rendered by the model's
image child (``sandbox.images.SandboxedImages``), answered as an ``ImagesResult``.

The order is checked here before anything runs (a bad one names its field, not retryable); the
model must be in the store as a diffusion model (``GgufInfo.is_diffusion``), else the job goes
back retryable for another worker. The usage sent is nothing: the queen bills an image by its
own count of megapixel-steps, never a worker's claim. Each finished render is told to
``on_rendered`` (the Jobs tab's thumbnail and its time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from desktop_worker.errors import UnsupportedRequest
from desktop_worker.sandbox.images import Rendering, SandboxedImages
from desktop_worker.store.gguf_info import GgufInfo
from shared_schema import Usage
from shared_schema.images import ImageOrder, ImagesResult

log = logging.getLogger(__name__)

NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)


class ImageModelMissing(Exception):
    """The order names a model this worker does not hold as a diffusion model."""


@dataclass(frozen=True, slots=True)
class RenderedJob:
    """What the owner's Jobs tab shows of a finished image job."""

    job_id: str
    model: str
    width: int
    height: int
    images: int
    render_s: float
    first_image_b64: str  # a thumbnail's source


def read_image_order(request: dict[str, Any]) -> ImageOrder:
    """The queen's order, checked; ``UnsupportedRequest`` naming the first bad field."""
    try:
        return ImageOrder.model_validate(request)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "order"
        raise UnsupportedRequest(f"the image order is malformed ({where}: "
                                 f"{first.get('msg', '')})") from exc


class ImageJobs:
    def __init__(self, engine: SandboxedImages, model_info: Callable[[str], GgufInfo | None],
                 model_path: Callable[[str], Path]) -> None:
        """``model_info(name)``: the store's facts of a model it holds (None: not held)."""
        self.engine = engine
        self.model_info = model_info
        self.model_path = model_path
        self.on_rendered: list[Callable[[RenderedJob], None]] = []

    async def run(self, job_id: str, request: dict[str, Any],
                  cancel: threading.Event) -> tuple[dict[str, Any], Usage]:
        order = read_image_order(request)
        info = self.model_info(order.model)
        if info is None or not info.is_diffusion:
            raise ImageModelMissing(f"this worker does not hold {order.model} as a diffusion "
                                    "model")
        rendering: Rendering = await self.engine.render(self.model_path(order.model), order,
                                                        cancel)
        result = ImagesResult(images=rendering.images, render_s=rendering.render_s)
        done = RenderedJob(job_id, order.model, order.width, order.height, order.n,
                           rendering.render_s, rendering.images[0].b64_json)
        log.info("image job %s: %d image(s) of %dx%d, %d steps, %s, in %.2f s", job_id,
                 order.n, order.width, order.height, order.steps, rendering.family,
                 rendering.render_s)
        for listener in self.on_rendered:
            listener(done)
        return result.model_dump(mode="json"), NO_USAGE

    async def close(self) -> None:
        await self.engine.close()
