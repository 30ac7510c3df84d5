"""What a worker delivers for an ``ImageOrder``, checked before any client sees it.

Each image must be what the order asked for: as many images as ``n``, each with its seed, each a
well-formed file of the order's format at exactly its width and height, no larger than
``image_bytes_bound`` of its size. Only the header is read to check the size, before any pixel is
decoded (a small file claiming a huge image is refused, never expanded), then the whole image is
decoded once to prove it is not truncated. Anything else is a ``BadDelivery``: the worker broke the
order, and the job goes to another worker.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Mapping
from typing import Any

from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError

from shared_schema.images import ImageOrder, ImagesResult, image_bytes_bound

# Pillow's names of the formats an order asks for.
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


class BadDelivery(Exception):
    """A worker's images do not match its order (the message says how)."""


def check_delivery(order: ImageOrder, data: Mapping[str, Any]) -> list[bytes]:
    """The order's images as bytes, in order, from a worker's ``Result.data``; ``BadDelivery``
    when anything about them is not what the order asked for."""
    try:
        result = ImagesResult.model_validate(data)
    except ValidationError as exc:
        raise BadDelivery(f"the result is not an images result: {exc.errors()[0]['msg']}") from exc
    if len(result.images) != order.n:
        raise BadDelivery(f"{len(result.images)} images for an order of {order.n}")
    images: list[bytes] = []
    most = image_bytes_bound(order.width, order.height)
    for index, (image, seed) in enumerate(zip(result.images, order.seeds(), strict=True)):
        if image.seed != seed:
            raise BadDelivery(f"image {index} has seed {image.seed}, not {seed}")
        try:
            raw = base64.b64decode(image.b64_json, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadDelivery(f"image {index} is not base64") from exc
        if len(raw) > most:
            raise BadDelivery(f"image {index} is {len(raw):,} bytes, over {most:,} for its size")
        check_image(raw, order, index)
        images.append(raw)
    return images


def check_image(raw: bytes, order: ImageOrder, index: int = 0) -> None:
    """``BadDelivery`` unless ``raw`` is a whole image of the order's format and size."""
    wanted = PIL_FORMATS[order.output_format]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=[wanted]) as picture:
                if picture.size != (order.width, order.height):
                    raise BadDelivery(f"image {index} is {picture.size[0]}x{picture.size[1]}, "
                                      f"not {order.width}x{order.height}")
                picture.load()
    except BadDelivery:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError,
            Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise BadDelivery(f"image {index} is not a whole {order.output_format} image: "
                          f"{exc}") from exc
