"""A scripted worker with the ``image`` capability (issue 38): real websockets, the real
protocol, and images made with Pillow from the order (a colour drawn from its prompt and
seed), encoded as the order asks. Behaviours play the hostile worker: ``wrong_size``,
``garbage`` (bytes that are no image), ``few`` (one image short), ``wrong_seed``, ``noise``
(random pixels of the right size), ``blank`` (one grey), ``other_model`` (another model's
image: the colour drawn from another name), and ``error`` (a retryable failure)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from typing import Any

from PIL import Image

from shared_schema import Job, JobError, Result, Usage
from shared_schema.capabilities import IMAGE
from shared_schema.hardware import ModelDescriptor
from shared_schema.images import IMAGES_URL, ImageOrder, ImagesResult, RenderedImage
from tests.support.workers import ScriptedWorker

IMAGE_MODEL = "test-org/tiny-sd-GGUF:Q8_0"
IMAGE_SHA256 = "1a" * 32
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def picture(order: ImageOrder, seed: int, size: tuple[int, int] | None = None,
            model: str | None = None) -> bytes:
    """The image an honest scripted worker renders for one seed of an order: a gradient of
    colours drawn from its model, prompt and seed."""
    seed_bytes = hashlib.sha256(f"{model or order.model}|{order.prompt}|{seed}".encode()).digest()
    width, height = size or (order.width, order.height)
    image = Image.new("RGB", (width, height))
    image.putdata([(seed_bytes[0] ^ (x * 4 % 256), seed_bytes[1] ^ (y * 4 % 256), seed_bytes[2])
                   for y in range(height) for x in range(width)])
    out = io.BytesIO()
    options: dict[str, Any] = {}
    if order.output_compression is not None:
        options["quality"] = order.output_compression
    image.save(out, PIL_FORMATS[order.output_format], **options)
    return out.getvalue()


class ImageWorker(ScriptedWorker):
    def __init__(self, ws_url: str, *, models: list[str] | None = None,
                 behaviour: str = "honest", claims: Usage | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("capabilities", [IMAGE])
        super().__init__(ws_url, models=[], **kwargs)
        self.models = [
            ModelDescriptor(name=name, size_bytes=300_000_000, parameter_count=450_000_000,
                            sha256=IMAGE_SHA256, loaded=True, kind="image")
            for name in (models if models is not None else [IMAGE_MODEL])
        ]
        self.image_behaviour = behaviour
        self.image_claims = claims
        self.orders: list[ImageOrder] = []

    async def _run(self, job: Job) -> None:
        if job.openai_url != IMAGES_URL:
            await super()._run(job)
            return
        order = ImageOrder.model_validate(job.openai_req)
        self.orders.append(order)
        behaviour = self.image_behaviour
        if behaviour == "error":
            await self._send(JobError(id=job.id, code="engine_error", retryable=True,
                                      message="scripted failure"))
            return
        images = []
        for seed in order.seeds():
            if behaviour == "wrong_size":
                raw = picture(order, seed, (order.width * 2, order.height))
            elif behaviour == "garbage":
                raw = os.urandom(2048)
            elif behaviour == "blank":
                blank = io.BytesIO()
                Image.new("RGB", (order.width, order.height), (128, 128, 128)).save(
                    blank, PIL_FORMATS[order.output_format])
                raw = blank.getvalue()
            elif behaviour == "other_model":
                raw = picture(order, seed, model="someone-else/tiny-model")
            elif behaviour == "noise":
                noise = Image.frombytes("RGB", (order.width, order.height),
                                        os.urandom(order.width * order.height * 3))
                out = io.BytesIO()
                noise.save(out, PIL_FORMATS[order.output_format])
                raw = out.getvalue()
            else:
                raw = picture(order, seed)
            images.append(RenderedImage(b64_json=base64.b64encode(raw).decode("ascii"),
                                        seed=seed + 1 if behaviour == "wrong_seed" else seed))
        if behaviour == "few":
            images = images[:-1] or images
        result = ImagesResult(images=images, render_s=0.5)
        usage = self.image_claims or Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        await self._send(Result(id=job.id, data=result.model_dump(mode="json"), usage=usage))
