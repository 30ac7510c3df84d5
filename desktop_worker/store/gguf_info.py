"""What a GGUF file says about its model: architecture, sizes, layers, chat template; and the
check that a model file is one llama.cpp may open.

Every model file enters the worker through here: downloads and imports (the store reads each
file's facts before it keeps it) and ``--model`` paths (imported into the store). The header is
read through a file object, never the tensor data, and checked whole against the file
(``shared_schema.gguf_check``: types, shapes, offsets, strings and arrays bounded, the chat
template's size, a split model's parts), so a bad file is refused with a plain-words
``InvalidModelFile`` before llama.cpp ever sees it. ``check_model_file`` runs the same checks on
every part llama.cpp will open, for the engine to call right before it loads a model.

It does not use ``gguf.GGUFReader``: that reader turns every vocabulary string into a numpy
array and takes about 3 s on the 98 MB SmolLM2 file on a 2-core machine. This reader skips
those arrays and takes about 10 ms; the tests check it against ``GGUFReader``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gguf.constants import LlamaFileType

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store.names import quant_tag, split_part
from shared_schema.diffusion_check import DIFFUSION_ARCHITECTURE
from shared_schema.errors import InvalidGgufFile
from shared_schema.gguf import GgufHeader, GgufTensor, as_int
from shared_schema.gguf_check import check_gguf_file, check_split_parts

__all__ = ["GgufInfo", "check_model_file", "read_gguf_info", "split_paths"]

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"^blk\.(\d+)\.")
# The architecture a diffusion model's facts carry: this, then its family ("diffusion:sdxs").
DIFFUSION_PREFIX = DIFFUSION_ARCHITECTURE


@dataclass(frozen=True)
class GgufInfo:
    """Facts about a GGUF model, read from its header (all parts of a split model)."""

    architecture: str
    name: str | None
    parameter_count: int
    block_count: int | None
    context_length: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    feed_forward_length: int | None
    vocab_size: int | None
    file_type: int | None
    quant: str | None
    chat_template: str | None
    size_bytes: int
    layer_bytes: tuple[int, ...]
    other_bytes: int
    tensor_count: int
    parts: int

    @property
    def is_diffusion(self) -> bool:
        """A diffusion model (issue 38, ``store.model_info``): served as images, never loaded
        by llama.cpp."""
        return self.architecture.startswith(DIFFUSION_PREFIX)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for the store's index)."""
        data = asdict(self)
        data["layer_bytes"] = list(self.layer_bytes)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GgufInfo:
        """Inverse of ``to_dict``; unknown keys are ignored, missing optional ones are None."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["layer_bytes"] = tuple(values.get("layer_bytes") or ())
        for f in fields(cls):
            values.setdefault(f.name, None)
        return cls(**values)


def read_gguf_info(path: Path) -> GgufInfo:
    """Read a GGUF model's facts; ``InvalidModelFile`` if it is not a GGUF file that passes
    ``shared_schema.gguf_check``.

    For the first part of a split model (``...-00001-of-0000N.gguf``) the other parts found
    beside it are read too: parameter_count, size_bytes and the byte counts cover all of them.
    """
    path = Path(path)
    parts = _read_parts(path, every_part=False)
    meta = parts[0].metadata
    tensors = [tensor for header in parts for tensor in header.tensors]
    arch = meta["general.architecture"]

    def arch_int(key: str) -> int | None:
        return as_int(meta.get(f"{arch}.{key}"))

    block_count = arch_int("block_count")
    layers, other = _bytes_by_block(tensors, block_count)
    file_type = as_int(meta.get("general.file_type"))
    template = meta.get("tokenizer.chat_template")
    vocab = arch_int("vocab_size") or parts[0].array_lengths.get("tokenizer.ggml.tokens")
    return GgufInfo(
        architecture=arch,
        name=meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
        parameter_count=sum(t.n_elements for t in tensors),
        block_count=block_count,
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        head_count=arch_int("attention.head_count"),
        head_count_kv=arch_int("attention.head_count_kv"),
        feed_forward_length=arch_int("feed_forward_length"),
        vocab_size=vocab,
        file_type=file_type,
        quant=_quant_label(file_type) or quant_tag(path.name),
        chat_template=template if isinstance(template, str) else None,
        size_bytes=sum(header.file_size for header in parts),
        layer_bytes=layers,
        other_bytes=other,
        tensor_count=len(tensors),
        parts=len(parts),
    )


def check_model_file(path: Path) -> None:
    """Check the model file llama.cpp is about to open, and every other part of a split model
    (each must be there): ``InvalidModelFile``, in plain words, if any is not a GGUF file that
    passes ``shared_schema.gguf_check``. Reads headers only (a few milliseconds)."""
    _read_parts(Path(path), every_part=True)


def split_paths(path: Path, count: int | None = None) -> list[Path]:
    """All part paths of a split model given its first part (just ``[path]`` otherwise).

    ``count`` (from the ``split.count`` metadata) wins over the count in the file name.
    """
    split = split_part(path.name)
    if split is None or split[1] != 1:
        return [path]
    base, _, named_count = split
    total = count if count and count > 0 else named_count
    return [path.with_name(f"{base}-{no:05d}-of-{total:05d}.gguf") for no in range(1, total + 1)]


def _quant_label(file_type: int | None) -> str | None:
    if file_type is None:
        return None
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return None
    if name == "GUESSED":
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _bytes_by_block(tensors: list[GgufTensor], block_count: int | None
                    ) -> tuple[tuple[int, ...], int]:
    per_block: dict[int, int] = {}
    other = 0
    for tensor in tensors:
        match = _BLOCK.match(tensor.name)
        n_bytes = tensor.n_bytes or 0
        if match is None:
            other += n_bytes
        else:
            index = int(match[1])
            per_block[index] = per_block.get(index, 0) + n_bytes
    count = max(block_count or 0, max(per_block, default=-1) + 1)
    return tuple(per_block.get(i, 0) for i in range(count)), other


# --- reading a file's header ------------------------------------------------------------------


def _read_parts(path: Path, *, every_part: bool) -> list[GgufHeader]:
    """The checked headers of ``path`` and of the other parts of its split model found beside
    it (all of them, or ``InvalidModelFile``, when ``every_part``), in order."""
    first = _read_header(path)
    meta = first.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModelFile(f"{path.name}: GGUF header has no general.architecture")
    count = as_int(meta.get("split.count"))
    part_paths = split_paths(path, count)
    if every_part and count is not None and count > 1 and len(part_paths) != count:
        raise InvalidModelFile(f"{path.name}: part 1 of a split model of {count} parts must be "
                               f"named <name>-00001-of-{count:05d}.gguf")
    headers = {0: first}
    for index, part in enumerate(part_paths[1:], start=1):
        if part.is_file():
            headers[index] = _read_header(part)
        elif every_part:
            raise InvalidModelFile(f"{path.name} is a split model; part {part.name} is missing")
        else:
            logger.warning("split model %s: part %s is missing", path.name, part.name)
    if count is not None:
        try:
            check_split_parts(headers, path.name, count)
        except InvalidGgufFile as exc:
            raise InvalidModelFile(str(exc)) from exc
    return [headers[index] for index in sorted(headers)]


def _read_header(path: Path) -> GgufHeader:
    try:
        with path.open("rb") as handle:
            return check_gguf_file(handle, path.name)
    except InvalidGgufFile as exc:
        raise InvalidModelFile(str(exc)) from exc
    except OSError as exc:
        raise InvalidModelFile(f"{path}: cannot read the file ({exc})") from exc
