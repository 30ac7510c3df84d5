"""A model's shape from its GGUF header: what fitting (``shared_schema.fitting``) needs to plan
a load, read from the header alone.

The queen reads only the first megabytes of a hub file, so tensor sizes come from the tensor
table's offsets (each tensor runs to the next one's offset; the last one to the end of the
file), not from each type's block size: that needs no table of quantization types and is right
for types newer than this code. The worker reads the same facts from the whole file
(``desktop_worker.store.gguf_info``); both feed ``fitting.plan_load`` and ``memory_cost_mb``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from shared_schema.gguf import GgufHeader, as_int

__all__ = ["GgufShape", "shape_of"]

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class GgufShape:
    """What fitting needs (``fitting.ModelShape``), plus whether the file carries a chat
    template (without one, chat requests fall back to a generic format)."""

    architecture: str | None
    block_count: int
    context_length: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    layer_bytes: tuple[int, ...]
    other_bytes: int
    has_chat_template: bool


def shape_of(parts: Sequence[tuple[GgufHeader, int]]) -> GgufShape:
    """The shape of a model from the headers of its parts (in order), each with its file's
    size in bytes. Metadata comes from the first part; tensors from all of them."""
    first = parts[0][0]
    meta = first.metadata
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else None

    def arch_int(key: str) -> int | None:
        return as_int(meta.get(f"{arch}.{key}")) if arch else None

    per_block: dict[int, int] = {}
    other = 0
    for header, file_size in parts:
        for name, n_bytes in _tensor_bytes(header, file_size):
            match = _BLOCK.match(name)
            if match is None:
                other += n_bytes
            else:
                index = int(match[1])
                per_block[index] = per_block.get(index, 0) + n_bytes
    blocks = max(arch_int("block_count") or 0, max(per_block, default=-1) + 1)
    template = meta.get("tokenizer.chat_template")
    return GgufShape(
        architecture=arch,
        block_count=blocks,
        context_length=arch_int("context_length"),
        embedding_length=arch_int("embedding_length"),
        head_count=arch_int("attention.head_count"),
        head_count_kv=arch_int("attention.head_count_kv"),
        layer_bytes=tuple(per_block.get(i, 0) for i in range(blocks)),
        other_bytes=other,
        has_chat_template=isinstance(template, str) and bool(template.strip()),
    )


def _tensor_bytes(header: GgufHeader, file_size: int) -> list[tuple[str, int]]:
    """Each tensor's bytes: from its offset to the next tensor's (or the file's end)."""
    ordered = sorted(header.tensors, key=lambda t: t.offset)
    data_size = max(file_size - header.data_start, 0)
    out = []
    for tensor, following in zip(ordered, [*ordered[1:], None], strict=True):
        end = following.offset if following is not None else data_size
        out.append((tensor.name, max(end - tensor.offset, 0)))
    return out
