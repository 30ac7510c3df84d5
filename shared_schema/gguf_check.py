"""Checks a GGUF model file's whole header against the file, before llama.cpp may open it.

Any uploader's GGUF reaches llama.cpp's loader, so the worker refuses a file whose header is
not one llama.cpp reads safely. ``shared_schema.gguf`` walks the header within ``GgufLimits``
(counts, string and array lengths, known value types, at most 4 dimensions, unique keys); this
module then checks what the walk read:

- every tensor: a ggml type this llama.cpp build knows (``GGML_TYPES``), each dimension at
  least 1, an element count and a byte size that a 64-bit integer holds, rows a whole number
  of the type's blocks, its offset aligned to ``general.alignment`` (itself a power of two,
  a uint32), its data inside the file and overlapping no other tensor's; names unique,
  printable, under 64 bytes;
- the metadata llama.cpp reads as raw arrays: the vocabulary's scores (float32) and token
  types (int32) as long as the vocabulary, the tokens and merges strings; the chat templates
  (``tokenizer.chat_template`` and ``tokenizer.chat_template.*``) strings within
  ``max_chat_template_bytes``; the keys read as strings are strings;
- a split model's ``split.*`` keys consistent within a part and across parts.

Everything fails with one ``GgufInvalid`` naming what is wrong, e.g. ``tensor
'blk.3.attn_q.weight': offset 123 is not aligned to 32``. Pure: the caller reads the bytes
(``check_gguf_file`` reads a file object's header, never its tensor data).
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from shared_schema.errors import GgufInvalid, GgufTruncated
from shared_schema.gguf import (
    GGUF_TYPE_ARRAY,
    GGUF_TYPE_STRING,
    GgufHeader,
    GgufLimits,
    GgufTensor,
    StringArrayMemo,
    parse_gguf_header,
    type_name,
)

__all__ = [
    "GGML_TYPES",
    "INT64_MAX",
    "GgmlType",
    "SeekableReader",
    "check_gguf_file",
    "check_gguf_header",
    "check_split_parts",
]

INT64_MAX = (1 << 63) - 1
FIRST_READ_BYTES = 4 << 20
_UINT32, _INT32, _FLOAT32, _UINT8, _INT8 = 4, 5, 6, 0, 1
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_STRING_KEYS = ("general.architecture", "general.name", "tokenizer.ggml.model",
                "tokenizer.ggml.pre")
_TEMPLATE_KEY = "tokenizer.chat_template"
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_MAX_SPLIT_PARTS = 0xFFFF  # llama.cpp keeps split.count in a uint16


class SeekableReader(Protocol):
    """What ``check_gguf_file`` reads through: an open binary file, or anything like one."""

    def seek(self, offset: int, whence: int = ..., /) -> int: ...

    def read(self, size: int = ..., /) -> bytes: ...


@dataclass(frozen=True, slots=True)
class GgmlType:
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


# The tensor types of the llama.cpp build the worker ships (ggml's type_traits, less the removed
# ones: 4, 5, 31-33 and 36-38 have no block size). tests/shared_schema/test_gguf_check.py checks
# this table against that build's libggml and against the ``gguf`` package.
GGML_TYPES: Mapping[int, GgmlType] = {
    0: GgmlType("F32", 1, 4),
    1: GgmlType("F16", 1, 2),
    2: GgmlType("Q4_0", 32, 18),
    3: GgmlType("Q4_1", 32, 20),
    6: GgmlType("Q5_0", 32, 22),
    7: GgmlType("Q5_1", 32, 24),
    8: GgmlType("Q8_0", 32, 34),
    9: GgmlType("Q8_1", 32, 36),
    10: GgmlType("Q2_K", 256, 84),
    11: GgmlType("Q3_K", 256, 110),
    12: GgmlType("Q4_K", 256, 144),
    13: GgmlType("Q5_K", 256, 176),
    14: GgmlType("Q6_K", 256, 210),
    15: GgmlType("Q8_K", 256, 292),
    16: GgmlType("IQ2_XXS", 256, 66),
    17: GgmlType("IQ2_XS", 256, 74),
    18: GgmlType("IQ3_XXS", 256, 98),
    19: GgmlType("IQ1_S", 256, 50),
    20: GgmlType("IQ4_NL", 32, 18),
    21: GgmlType("IQ3_S", 256, 110),
    22: GgmlType("IQ2_S", 256, 82),
    23: GgmlType("IQ4_XS", 256, 136),
    24: GgmlType("I8", 1, 1),
    25: GgmlType("I16", 1, 2),
    26: GgmlType("I32", 1, 4),
    27: GgmlType("I64", 1, 8),
    28: GgmlType("F64", 1, 8),
    29: GgmlType("IQ1_M", 256, 56),
    30: GgmlType("BF16", 1, 2),
    34: GgmlType("TQ1_0", 256, 54),
    35: GgmlType("TQ2_0", 256, 66),
    39: GgmlType("MXFP4", 32, 17),
    40: GgmlType("NVFP4", 64, 36),
    41: GgmlType("Q1_0", 128, 18),
    42: GgmlType("Q2_0", 64, 18),
}


def check_gguf_header(
    buf: bytes | bytearray | memoryview | mmap.mmap,
    name: str,
    file_size: int | None = None,
    *,
    limits: GgufLimits | None = None,
    memo: StringArrayMemo | None = None,
) -> GgufHeader:
    """Read and check the header at the start of ``buf`` (a bytes-like object or an mmap: the
    whole file, or its first bytes when ``file_size`` says more follow). Returns the header
    with each tensor's ``n_bytes`` set.

    ``GgufInvalid`` names the first thing wrong; ``GgufTruncated`` if ``buf`` is a prefix that
    ends inside the header (read at least ``needed`` bytes and call again).
    """
    limits = limits or GgufLimits()
    header = parse_gguf_header(buf, name, file_size, limits=limits, memo=memo)
    size = header.file_size
    _check_metadata(header, name, limits)
    header.tensors = _checked_tensors(header, name, size)
    return header


def check_gguf_file(
    handle: SeekableReader,
    name: str,
    *,
    limits: GgufLimits | None = None,
    memo: StringArrayMemo | None = None,
    first_read_bytes: int = FIRST_READ_BYTES,
) -> GgufHeader:
    """``check_gguf_header`` over an open binary file: reads its first ``first_read_bytes``,
    and more (doubling) while the header goes on, never past ``limits.max_header_bytes``."""
    limits = limits or GgufLimits()
    file_size = handle.seek(0, os.SEEK_END)
    nbytes = min(first_read_bytes, file_size, limits.max_header_bytes)
    while True:
        handle.seek(0)
        data = handle.read(nbytes)
        try:
            return check_gguf_header(data, name, file_size, limits=limits, memo=memo)
        except GgufTruncated as exc:
            if len(data) < nbytes or exc.needed > limits.max_header_bytes:
                raise GgufInvalid(
                    f"{name}: the header goes on past {min(len(data), nbytes):,} bytes; at most "
                    f"{limits.max_header_bytes:,} are read") from exc
            nbytes = min(max(exc.needed, 2 * nbytes), file_size, limits.max_header_bytes)


def check_split_parts(parts: Mapping[int, GgufHeader], name: str, count: int) -> None:
    """A split model's parts (by index from 0; some may be missing) agree: each names its own
    index and the same count, no tensor is in two parts, and when all ``count`` parts are
    there their tensors add up to ``split.tensors.count``."""
    seen: dict[str, int] = {}
    for index, header in sorted(parts.items()):
        meta = header.metadata
        if meta.get("split.no") != index or meta.get("split.count") != count:
            raise GgufInvalid(
                f"{name}: part {index + 1} of {count} says it is part "
                f"{_part_label(meta.get('split.no'))} of {meta.get('split.count')!r}")
        for tensor in header.tensors:
            if tensor.name in seen:
                raise GgufInvalid(f"{name}: tensor {tensor.name!r} is in part "
                                  f"{seen[tensor.name] + 1} and in part {index + 1}")
            seen[tensor.name] = index
    declared = parts[0].metadata.get("split.tensors.count") if 0 in parts else None
    if len(parts) == count and declared is not None and declared != len(seen):
        raise GgufInvalid(f"{name}: split.tensors.count is {declared}, but the {count} parts "
                          f"hold {len(seen)} tensors")


# --- metadata ---------------------------------------------------------------------------------


def _check_metadata(header: GgufHeader, name: str, limits: GgufLimits) -> None:
    types, meta = header.value_types, header.metadata
    if "general.alignment" in types:
        alignment = meta["general.alignment"]
        if types["general.alignment"] != _UINT32:
            raise GgufInvalid(f"{name}: general.alignment is a "
                              f"{type_name(types['general.alignment'])}, not a uint32")
        if alignment & (alignment - 1):
            raise GgufInvalid(f"{name}: general.alignment {alignment} is not a power of two")
    for key in _STRING_KEYS:
        _expect(header, name, key, GGUF_TYPE_STRING)
    for key, vtype in types.items():
        if key == _TEMPLATE_KEY or key.startswith(_TEMPLATE_KEY + "."):
            _expect(header, name, key, GGUF_TYPE_STRING)
            size = len(meta[key].encode("utf-8"))
            if size > limits.max_chat_template_bytes:
                raise GgufInvalid(f"{name}: the chat template {key!r} is {size:,} bytes; at "
                                  f"most {limits.max_chat_template_bytes:,} are allowed")
        elif key.startswith("split.") and key in _SPLIT_KEYS and vtype not in _INTEGER_TYPES:
            raise GgufInvalid(f"{name}: {key} is a {type_name(vtype)}, not an integer")
    _check_vocabulary(header, name)
    _check_split_keys(header, name, limits)


def _expect(header: GgufHeader, name: str, key: str, vtype: int,
            items: tuple[int, ...] = ()) -> None:
    """``key``, if present, has value type ``vtype`` (an array: of one of ``items``)."""
    have = header.value_types.get(key)
    if have is None:
        return
    have_item = header.array_types.get(key)
    if have == vtype and (not items or have_item in items):
        return
    found = f"an array of {type_name(have_item)}" if have_item is not None \
        else f"a {type_name(have)}"
    wanted = f"an array of {type_name(items[0])}" if items else f"a {type_name(vtype)}"
    raise GgufInvalid(f"{name}: {key} is {found}; llama.cpp reads it as {wanted}")


def _check_vocabulary(header: GgufHeader, name: str) -> None:
    """The arrays llama.cpp reads as raw memory, indexed by token id: of the right item type
    and as long as the token list (a shorter one would be read past its end)."""
    _expect(header, name, "tokenizer.ggml.tokens", GGUF_TYPE_ARRAY, (GGUF_TYPE_STRING,))
    _expect(header, name, "tokenizer.ggml.merges", GGUF_TYPE_ARRAY, (GGUF_TYPE_STRING,))
    _expect(header, name, "tokenizer.ggml.scores", GGUF_TYPE_ARRAY, (_FLOAT32,))
    _expect(header, name, "tokenizer.ggml.token_type", GGUF_TYPE_ARRAY, (_INT32,))
    _expect(header, name, "tokenizer.ggml.precompiled_charsmap", GGUF_TYPE_ARRAY,
            (_UINT8, _INT8))
    n_tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    if n_tokens is None:
        return
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        length = header.array_lengths.get(key)
        if length is not None and length != n_tokens:
            raise GgufInvalid(f"{name}: {key} has {length:,} items for {n_tokens:,} tokens")


def _check_split_keys(header: GgufHeader, name: str, limits: GgufLimits) -> None:
    meta = header.metadata
    present = [key for key in _SPLIT_KEYS if key in meta]
    if not present:
        return
    no, count = meta.get("split.no"), meta.get("split.count")
    if no is None or count is None:
        raise GgufInvalid(f"{name}: a split model's part names both split.no and split.count")
    if not 1 <= count <= _MAX_SPLIT_PARTS or not 0 <= no < count:
        raise GgufInvalid(f"{name}: split.no {no} and split.count {count} do not fit together")
    total = meta.get("split.tensors.count")
    if total is not None and not len(header.tensors) <= total <= count * limits.max_tensor_count:
        raise GgufInvalid(f"{name}: split.tensors.count is {total}, but this part alone holds "
                          f"{len(header.tensors)} tensors")
    if total is not None and count == 1 and total != len(header.tensors):
        raise GgufInvalid(f"{name}: split.tensors.count is {total}, but the model's one part "
                          f"holds {len(header.tensors)} tensors")


def _part_label(no: Any) -> str:
    return str(no + 1) if isinstance(no, int) and not isinstance(no, bool) else repr(no)


# --- the tensor table -------------------------------------------------------------------------


def _checked_tensors(header: GgufHeader, name: str, file_size: int) -> list[GgufTensor]:
    alignment = header.alignment
    data_size = file_size - header.data_start
    if header.tensors and data_size < 0:
        raise GgufInvalid(f"{name}: the file is truncated (its tensor data would start at byte "
                          f"{header.data_start:,}; the file has {file_size:,} bytes)")
    checked: list[GgufTensor] = []
    names: set[str] = set()
    for tensor in header.tensors:
        where = f"{name}: tensor {tensor.name!r}"
        _check_name(tensor.name, names, where)
        kind = GGML_TYPES.get(tensor.ggml_type)
        if kind is None:
            raise GgufInvalid(f"{where}: unknown ggml type {tensor.ggml_type}")
        n_bytes = _tensor_bytes(tensor, kind, where)
        if tensor.offset % alignment:
            raise GgufInvalid(f"{where}: offset {tensor.offset} is not aligned to {alignment}")
        end = tensor.offset + n_bytes
        if end > data_size:
            raise GgufInvalid(
                f"{where}: the file is truncated or the offset is wrong (the tensor ends at "
                f"byte {header.data_start + end:,}; the file has {file_size:,})")
        checked.append(GgufTensor(tensor.name, tensor.n_elements, tensor.ggml_type,
                                  tensor.offset, tensor.shape, n_bytes))
    _check_overlaps(checked, name)
    return checked


def _check_name(tensor_name: str, names: set[str], where: str) -> None:
    if not tensor_name or not tensor_name.isprintable():
        raise GgufInvalid(f"{where}: a tensor name must be printable and not empty")
    if tensor_name in names:
        raise GgufInvalid(f"{where}: two tensors have this name")
    names.add(tensor_name)


def _tensor_bytes(tensor: GgufTensor, kind: GgmlType, where: str) -> int:
    shape = tensor.shape
    if any(not 1 <= dim <= INT64_MAX for dim in shape):
        raise GgufInvalid(f"{where}: shape {list(shape)} has a dimension below 1 or past "
                          "a 64-bit integer")
    if tensor.n_elements >= INT64_MAX:
        raise GgufInvalid(f"{where}: shape {list(shape)} has {tensor.n_elements:,} elements, "
                          "more than a 64-bit integer counts")
    if shape[0] % kind.block_size:
        raise GgufInvalid(f"{where}: rows of {shape[0]} elements are not a whole number of "
                          f"{kind.name} blocks ({kind.block_size} elements)")
    n_bytes = tensor.n_elements // kind.block_size * kind.type_size
    if n_bytes > INT64_MAX:
        raise GgufInvalid(f"{where}: {n_bytes:,} bytes is more than a 64-bit integer counts")
    return n_bytes


def _check_overlaps(tensors: list[GgufTensor], name: str) -> None:
    ordered = sorted(tensors, key=lambda t: t.offset)
    for before, after in itertools.pairwise(ordered):
        if before.offset + (before.n_bytes or 0) > after.offset:
            raise GgufInvalid(f"{name}: tensor {after.name!r} (offset {after.offset}) overlaps "
                              f"tensor {before.name!r} (bytes {before.offset} to "
                              f"{before.offset + (before.n_bytes or 0)})")
