"""Which kind of model a file is, and its facts: an LLM's GGUF for llama.cpp
(``gguf_info.read_gguf_info``), or a diffusion model for stable-diffusion.cpp (issue 38).

A diffusion model's facts are a ``GgufInfo`` too, so the store keeps, lists, evicts and counts
both alike: its ``architecture`` is ``DIFFUSION_PREFIX`` + its family as stable-diffusion.cpp
detects it (``shared_schema.diffusion_check``, which checks the header whole, GGUF or
safetensors), its ``parameter_count`` every tensor's elements, and it has no layers, context or
chat template. ``is_diffusion`` tells them apart; such a model is announced with ``kind``
"image" and served only by the image engine.
"""

from __future__ import annotations

from pathlib import Path

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store.gguf_info import DIFFUSION_PREFIX, GgufInfo, read_gguf_info
from shared_schema.diffusion_check import model_file_kind, read_diffusion_shape
from shared_schema.errors import InvalidDiffusionModel

__all__ = ["read_model_info"]


def read_model_info(path: Path) -> GgufInfo:
    """A model file's facts, whichever engine it is for; ``InvalidModelFile`` when it is
    neither a GGUF llama.cpp may open nor a diffusion model stable-diffusion.cpp renders."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            kind = model_file_kind(handle, path.name)
    except InvalidDiffusionModel:
        kind = "llm"  # no diffusion model: the GGUF checks say what is wrong with it
    except OSError as exc:
        raise InvalidModelFile(f"{path.name} cannot be read: {exc}") from exc
    if kind == "llm":
        return read_gguf_info(path)
    try:
        with path.open("rb") as handle:
            shape = read_diffusion_shape(handle, path.name)
    except InvalidDiffusionModel as exc:
        raise InvalidModelFile(str(exc)) from exc
    incomplete = shape.incomplete(path.name)
    if incomplete is not None:
        raise InvalidModelFile(incomplete)
    return GgufInfo(
        architecture=DIFFUSION_PREFIX + shape.family, name=None,
        parameter_count=shape.parameter_count, block_count=None, context_length=None,
        embedding_length=None, head_count=None, head_count_kv=None, feed_forward_length=None,
        vocab_size=None, file_type=None, quant=None, chat_template=None,
        size_bytes=shape.file_size, layer_bytes=(), other_bytes=shape.file_size,
        tensor_count=shape.tensor_count, parts=1)
