"""What a GGUF file says about its model: architecture, sizes, layers, chat template.

``read_gguf_info`` reads only the header (metadata and tensor table) through a read-only memory
map, never tensor data. It does not use ``gguf.GGUFReader``: that reader turns every vocabulary
string into a numpy array and takes about 3 s on the 98 MB SmolLM2 file on a 2-core machine.
This reader skips those arrays and takes a few tens of milliseconds; it uses the ``gguf``
package's constants (value types, quantization block sizes, file types), and the tests check it
against ``GGUFReader``.
"""

from __future__ import annotations

import logging
import mmap
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store.names import quant_tag, split_part
from shared_schema.errors import InvalidGgufFile
from shared_schema.gguf import GgufHeader, as_int, parse_gguf_header

__all__ = ["GgufInfo", "read_gguf_info", "split_paths"]

logger = logging.getLogger(__name__)

_BLOCK = re.compile(r"^blk\.(\d+)\.")


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


@dataclass
class _Tensor:
    name: str
    n_elements: int
    n_bytes: int | None
    offset: int


@dataclass
class _Header:
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[_Tensor]
    file_size: int


def read_gguf_info(path: Path) -> GgufInfo:
    """Read a GGUF model's facts; ``InvalidModelFile`` if it is not a readable GGUF file.

    For the first part of a split model (``...-00001-of-0000N.gguf``) the other parts found
    beside it are read too: parameter_count, size_bytes and the byte counts cover all of them.
    """
    path = Path(path)
    first = _read_header(path)
    meta = first.metadata
    tensors = list(first.tensors)
    size = first.file_size
    part_paths = split_paths(path, as_int(meta.get("split.count")))
    for part in part_paths[1:]:
        if not part.is_file():
            logger.warning("split model %s: part %s is missing", path.name, part.name)
            continue
        header = _read_header(part)
        tensors.extend(header.tensors)
        size += header.file_size
    parts = 1 + sum(1 for p in part_paths[1:] if p.is_file())

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModelFile(f"{path.name}: GGUF header has no general.architecture")

    def arch_int(key: str) -> int | None:
        return as_int(meta.get(f"{arch}.{key}"))

    block_count = arch_int("block_count")
    layers, other = _bytes_by_block(tensors, block_count)
    file_type = as_int(meta.get("general.file_type"))
    template = meta.get("tokenizer.chat_template")
    vocab = arch_int("vocab_size") or first.array_lengths.get("tokenizer.ggml.tokens")
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
        size_bytes=size,
        layer_bytes=layers,
        other_bytes=other,
        tensor_count=len(tensors),
        parts=parts,
    )


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


def _bytes_by_block(tensors: list[_Tensor], block_count: int | None) -> tuple[tuple[int, ...], int]:
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


def _read_header(path: Path) -> _Header:
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            if size < 24:
                raise InvalidModelFile(f"{path.name}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _from_header(parse_gguf_header(buf, path.name), path.name, size)
    except InvalidModelFile:
        raise
    except InvalidGgufFile as exc:
        raise InvalidModelFile(str(exc)) from exc
    except OSError as exc:
        raise InvalidModelFile(f"{path}: cannot read the file ({exc})") from exc
    except (ValueError, OverflowError, MemoryError) as exc:
        raise InvalidModelFile(f"{path.name}: not a readable GGUF file ({exc})") from exc


def _from_header(header: GgufHeader, name: str, size: int) -> _Header:
    tensors = [_Tensor(t.name, t.n_elements, _tensor_bytes(t.ggml_type, t.n_elements), t.offset)
               for t in header.tensors]
    _fill_unknown_sizes(tensors, size - header.data_start)
    for tensor in tensors:
        end = header.data_start + tensor.offset + (tensor.n_bytes or 0)
        if end > size:
            raise InvalidModelFile(
                f"{name}: the file is truncated (tensor {tensor.name!r} ends at byte {end}, "
                f"the file has {size})"
            )
    return _Header(header.metadata, header.array_lengths, tensors, size)


def _tensor_bytes(ggml_type: int, n_elements: int) -> int | None:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None  # a type newer than the installed gguf package: sized from the offsets
    return n_elements // block_size * type_size


def _fill_unknown_sizes(tensors: list[_Tensor], data_size: int) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for tensor, following in zip(ordered, [*ordered[1:], None], strict=True):
        if tensor.n_bytes is None:
            end = following.offset if following is not None else data_size
            tensor.n_bytes = max(end - tensor.offset, 0)
