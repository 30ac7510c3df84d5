"""From an images request to the order a worker renders, and what it costs (pure).

Every setting is resolved here, the seed included (drawn when the client left it out), so the
order says everything a second worker needs to render the same images: an audit re-renders it.
An image is priced by the queen's own count, never the worker's: its megapixels times its steps
(``shared_schema.images.megapixel_steps``), converted to "image tokens" at
``tokens_per_megapixel_step`` and billed at the model's completion price per token (its size
class, as for text). A 512x512 image of 20 steps at the default 100 tokens per megapixel-step
is 525 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from queen_server.swarm.metering import Meter, counted
from shared_schema import Usage
from shared_schema.images import (
    MAX_SEED,
    ImageGenerationRequest,
    ImageOrder,
    megapixel_steps,
    parse_size,
    steps_for,
)

DEFAULT_GUIDANCE = 7.0
DEFAULT_SAMPLER = "euler_a"


def order_of(req: ImageGenerationRequest, draw_seed: Callable[[int], int]) -> ImageOrder:
    """The order for ``req``; ``draw_seed(upper)`` draws a seed in [0, upper] when the client
    gave none (upper leaves room for every image's seed)."""
    width, height = parse_size(req.size)
    seed = req.seed if req.seed is not None else draw_seed(MAX_SEED - req.n + 1)
    return ImageOrder(
        model=req.model, prompt=req.prompt, negative_prompt=req.negative_prompt or "",
        width=width, height=height, steps=steps_for(req.quality, req.steps),
        guidance=req.guidance if req.guidance is not None else DEFAULT_GUIDANCE,
        sampler=req.sampler or DEFAULT_SAMPLER, seed=seed, n=req.n,
        output_format=req.output_format, output_compression=req.output_compression)


def image_tokens(order: ImageOrder, tokens_per_megapixel_step: float) -> int:
    """What the order's images are billed as: its megapixel-steps at the queen's rate, rounded
    up, at least one token."""
    work = megapixel_steps(order.width, order.height, order.steps, order.n)
    return max(1, math.ceil(work * tokens_per_megapixel_step))


def images_answer(created: int, order: ImageOrder, quality: str,
                  data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """OpenAI's ``ImagesResponse`` for the order's images (``data``: each ``{"b64_json"}`` or
    ``{"url"}``), with Apiary's ``apiary`` extension: the seed and steps used, and the image
    tokens billed."""
    return {
        "created": created,
        "data": data,
        "background": "opaque",
        "output_format": order.output_format,
        "quality": quality,
        "size": f"{order.width}x{order.height}",
        "apiary": {"seed": order.seed, "seeds": order.seeds(), "steps": order.steps,
                   "guidance": order.guidance, "sampler": order.sampler,
                   "billed_tokens": tokens},
    }


@dataclass(frozen=True, slots=True)
class ImageMeter(Meter):
    """An image job's bill: the queen's own count (``tokens``), whatever the worker claims."""

    tokens: int = 0

    def completion_bound(self, delivered_bytes: int) -> int:
        return self.tokens

    def bill(self, claimed: Usage, delivered_bytes: int) -> Usage:
        return counted(0, self.tokens)

    @classmethod
    def of(cls, order: ImageOrder, tokens_per_megapixel_step: float) -> ImageMeter:
        return cls(0, 0, 0, image_tokens(order, tokens_per_megapixel_step))
