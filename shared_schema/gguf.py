"""The GGUF file header: metadata and tensor table, parsed from a buffer (never tensor data).

Both sides read it. The worker maps its model files and reads facts for placement and the
store's index (``desktop_worker.store.gguf_info``). The queen reads the first few megabytes of a
hub file over an HTTP Range request and prices the model by its own count of parameters
(``queen_server.catalog``), never by a worker's word. So the buffer may be a prefix of the file:
running off its end raises ``GgufTruncated`` (read more), while a header that contradicts itself
or the file's size raises ``InvalidGgufFile``.

Long arrays (vocabularies, merges) are skipped and only counted: turning every vocabulary string
into an object is what makes ``gguf.GGUFReader`` take seconds on a small model. The format's
constants are written out here (they are fixed by the GGUF specification), so this module needs
no numpy and no ``gguf`` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from typing import Any

from shared_schema.errors import GgufTruncated, InvalidGgufFile

__all__ = [
    "GGUF_DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "GgufHeader",
    "GgufTensor",
    "as_int",
    "parse_gguf_header",
]

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (the specification's gguf_metadata_value_type).
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
KEEP_ARRAY_ITEMS = 256  # arrays longer than this (vocabularies) are skipped, only counted
_MAX_DIMS = 8


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    n_elements: int
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(slots=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[GgufTensor] = field(default_factory=list)
    header_bytes: int = 0  # where the tensor table ends
    data_start: int = 0  # where tensor data begins (aligned)

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)


def parse_gguf_header(
    buf: bytes | bytearray | memoryview | mmap.mmap, name: str, file_size: int | None = None
) -> GgufHeader:
    """Parse the header at the start of ``buf``, the first bytes of a file of ``file_size``
    bytes (``None``: ``buf`` is the whole file).

    ``GgufTruncated`` if the header runs past the end of a partial ``buf`` (its ``needed`` says
    at least how many bytes to read); ``InvalidGgufFile`` for anything else wrong.
    """
    with memoryview(buf) as raw, raw.cast("B") as view:  # released even on errors, so that
        size = len(view) if file_size is None else file_size  # a caller's mmap can close
        try:
            return _parse(_Cursor(view, name, size), name, size)
        except (ValueError, OverflowError, MemoryError) as exc:
            raise InvalidGgufFile(f"{name}: not a readable GGUF file ({exc})") from exc


def as_int(value: Any) -> int | None:
    """An integer metadata value; a per-layer list counts as its largest item."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return max(value)  # per-layer values (e.g. head counts of some architectures)
    return None


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, with bounds checks."""

    def __init__(self, buf: memoryview, name: str, file_size: int) -> None:
        self.buf = buf
        self.pos = 0
        self.order = "<"
        self.name = name
        self.file_size = file_size

    def fail(self, what: str) -> InvalidGgufFile:
        return InvalidGgufFile(f"{self.name}: not a readable GGUF file ({what})")

    def short(self, end: int) -> InvalidGgufFile:
        if end > self.file_size or len(self.buf) >= self.file_size:
            return self.fail(f"header ends early at byte {self.pos}")
        return GgufTruncated(f"{self.name}: the header goes on past byte {len(self.buf)}", end)

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        if self.pos + width > len(self.buf):
            raise self.short(self.pos + width)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += width
        return value

    def skip(self, n: int) -> None:
        if n < 0:
            raise self.fail(f"negative length at byte {self.pos}")
        if self.pos + n > len(self.buf):
            raise self.short(self.pos + n)
        self.pos += n

    def string(self) -> str:
        n = self.unpack("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, array_lengths: dict[str, int]) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(key, array_lengths)
        raise self.fail(f"unknown value type {vtype} for {key!r}")

    def array(self, key: str, array_lengths: dict[str, int]) -> list[Any] | None:
        item_type = self.unpack("I")
        count = self.unpack("Q")
        array_lengths[key] = count
        if count > self.file_size - self.pos:  # every item takes at least one byte
            raise self.fail(f"array {key!r} claims {count} items")
        if count <= KEEP_ARRAY_ITEMS:
            return [self.value(item_type, key, {}) for _ in range(count)]
        if item_type in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item_type]))
        elif item_type == _STRING:
            for _ in range(count):
                self.skip(self.unpack("Q"))
        else:
            for _ in range(count):
                self.value(item_type, key, {})
        return None


def _parse(cur: _Cursor, name: str, size: int) -> GgufHeader:
    if size < 24:
        raise InvalidGgufFile(f"{name}: not a GGUF file (only {size} bytes)")
    if cur.unpack("I") != GGUF_MAGIC:
        raise InvalidGgufFile(f"{name}: not a GGUF file (bad magic number)")
    version = cur.unpack("I")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise InvalidGgufFile(f"{name}: GGUF version {version} is not supported (only 2 and 3)")
    tensor_count = cur.unpack("Q")
    kv_count = cur.unpack("Q")
    if tensor_count > size or kv_count > size:
        raise cur.fail("impossible tensor or key counts")

    header = GgufHeader(version=version, metadata={})
    for _ in range(kv_count):
        key = cur.string()
        header.metadata[key] = cur.value(cur.unpack("I"), key, header.array_lengths)

    for _ in range(tensor_count):
        tensor_name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > _MAX_DIMS:
            raise cur.fail(f"tensor {tensor_name!r} has {n_dims} dimensions")
        n_elements = 1
        for _ in range(n_dims):
            n_elements *= cur.unpack("Q")
        ggml_type = cur.unpack("I")
        offset = cur.unpack("Q")
        header.tensors.append(GgufTensor(tensor_name, n_elements, ggml_type, offset))

    alignment = as_int(header.metadata.get("general.alignment")) or GGUF_DEFAULT_ALIGNMENT
    if alignment <= 0:
        raise cur.fail(f"alignment {alignment}")
    header.header_bytes = cur.pos
    header.data_start = -(-cur.pos // alignment) * alignment
    return header
