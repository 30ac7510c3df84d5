"""The GGUF file header: metadata and tensor table, parsed from a buffer (never tensor data).

Both sides read it. The worker reads its model files' headers for placement, the store's index
and the checks made before llama.cpp may open a file (``shared_schema.gguf_check``). The queen
reads the first few megabytes of a hub file over an HTTP Range request and prices the model by
its own count of parameters (``queen_server.catalog``), never by a worker's word. So the buffer
may be a prefix of the file: running off its end raises ``GgufTruncated`` (read more), while a
header that contradicts itself or the file's size raises ``GgufInvalid``.

The walk is bounded (``GgufLimits``): counts, string lengths and array lengths are checked
before anything is allocated or looped over, so a hostile header costs at most a pass over its
own bytes. What llama.cpp's reader refuses is refused here too: big-endian files, arrays of
arrays, tensors of more than 4 dimensions, repeated keys, tensor names of 64 bytes or more.

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

from shared_schema.errors import GgufInvalid, GgufTruncated, InvalidGgufFile

__all__ = [
    "GGML_MAX_DIMS",
    "GGUF_DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "GGUF_TYPE_ARRAY",
    "GGUF_TYPE_STRING",
    "GgufHeader",
    "GgufLimits",
    "GgufTensor",
    "StringArrayMemo",
    "as_int",
    "parse_gguf_header",
    "type_name",
]

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4  # ggml's tensors have at most 4 dimensions

# GGUF metadata value types (the specification's gguf_metadata_value_type).
GGUF_TYPE_STRING, GGUF_TYPE_ARRAY = 8, 9
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),  # uint8
    1: struct.Struct("<b"),  # int8
    2: struct.Struct("<H"),  # uint16
    3: struct.Struct("<h"),  # int16
    4: struct.Struct("<I"),  # uint32
    5: struct.Struct("<i"),  # int32
    6: struct.Struct("<f"),  # float32
    7: struct.Struct("<?"),  # bool
    10: struct.Struct("<Q"),  # uint64
    11: struct.Struct("<q"),  # int64
    12: struct.Struct("<d"),  # float64
}
_U32 = _SCALARS[4]
_U64 = _SCALARS[10]
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32",
               6: "float32", 7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64",
               12: "float64"}
KEEP_ARRAY_ITEMS = 256  # arrays longer than this (vocabularies) are skipped, only counted
_MIN_KV_BYTES = 8 + 4 + 1  # a key's length, a type and the smallest value
_MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length and one byte, dims, one dim, type, offset


def type_name(value_type: int) -> str:
    """A GGUF metadata value type's name, for messages."""
    return _TYPE_NAMES.get(value_type, f"type {value_type}")


@dataclass(frozen=True, slots=True)
class GgufLimits:
    """Bounds on what a header may claim, checked while it is read: a header past them is
    refused before anything is allocated or walked. The defaults fit every published model
    with room to spare (the largest vocabularies hold about 260,000 tokens; the longest chat
    templates about 20 KB; tensor names are ggml's, under 64 bytes)."""

    max_kv_count: int = 1 << 16
    max_tensor_count: int = 1 << 16
    max_key_bytes: int = 1 << 10
    max_string_bytes: int = 1 << 20
    max_array_items: int = 1 << 22
    max_tensor_name_bytes: int = 63  # ggml's GGML_MAX_NAME (64) less the final NUL
    max_chat_template_bytes: int = 128 << 10  # checked by gguf_check
    max_header_bytes: int = 256 << 20  # how much gguf_check.check_gguf_file reads at most


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    n_elements: int
    ggml_type: int
    offset: int  # from the start of the data section
    shape: tuple[int, ...] = ()  # ne[0] (a row) first, as ggml counts
    n_bytes: int | None = None  # set by gguf_check, from the type's block size


@dataclass(slots=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int] = field(default_factory=dict)
    tensors: list[GgufTensor] = field(default_factory=list)
    header_bytes: int = 0  # where the tensor table ends
    data_start: int = 0  # where tensor data begins (aligned)
    value_types: dict[str, int] = field(default_factory=dict)  # each key's GGUF value type
    array_types: dict[str, int] = field(default_factory=dict)  # each array's item type
    alignment: int = GGUF_DEFAULT_ALIGNMENT
    file_size: int = 0  # the whole file's, as the reader was told

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)


class StringArrayMemo:
    """Where long string arrays already walked end, kept with their exact bytes.

    For checking many near-copies of one header (the fuzz corpus of ``gguf_check``): a
    vocabulary that did not change is compared byte for byte with the one walked before
    instead of being walked again, so the answer is the walk's own. Bounded: the entries
    hold at most ``max_bytes`` in all (the oldest go first)."""

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, int, int], tuple[int, bytes]] = {}
        self.hits = 0

    def end_of(self, buf: memoryview, pos: int, count: int, max_len: int) -> int | None:
        entry = self._entries.get((pos, count, max_len))
        if entry is None:
            return None
        end, data = entry
        if end <= len(buf) and bytes(buf[pos:end]) == data:  # memcmp; a view compares slowly
            self.hits += 1
            return end
        return None

    def remember(self, buf: memoryview, pos: int, count: int, max_len: int, end: int) -> None:
        if end - pos > self.max_bytes:
            return
        self._entries[(pos, count, max_len)] = (end, bytes(buf[pos:end]))
        while sum(len(data) for _, data in self._entries.values()) > self.max_bytes:
            del self._entries[next(iter(self._entries))]


def parse_gguf_header(
    buf: bytes | bytearray | memoryview | mmap.mmap,
    name: str,
    file_size: int | None = None,
    *,
    limits: GgufLimits | None = None,
    memo: StringArrayMemo | None = None,
) -> GgufHeader:
    """Parse the header at the start of ``buf``, the first bytes of a file of ``file_size``
    bytes (``None``: ``buf`` is the whole file), within ``limits`` (the defaults if None).

    ``GgufTruncated`` if the header runs past the end of a partial ``buf`` (its ``needed`` says
    at least how many bytes to read); ``GgufInvalid`` for anything else wrong. The tensor table
    is read as it is written: ``shared_schema.gguf_check`` checks it against the file.
    """
    with memoryview(buf) as raw, raw.cast("B") as view:  # released even on errors, so that
        size = len(view) if file_size is None else file_size  # a caller's mmap can close
        walker = _Walker(view, name, size, limits or GgufLimits(), memo)
        try:
            return walker.header()
        except InvalidGgufFile:
            raise
        except (ValueError, OverflowError, MemoryError, struct.error) as exc:
            raise walker.fail(str(exc)) from exc


def as_int(value: Any) -> int | None:
    """An integer metadata value; a per-layer list counts as its largest item."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return max(value)  # per-layer values (e.g. head counts of some architectures)
    return None


class _Walker:
    """Reads a little-endian GGUF header from a buffer, every length bounded before use."""

    def __init__(self, buf: memoryview, name: str, file_size: int, limits: GgufLimits,
                 memo: StringArrayMemo | None) -> None:
        self.buf = buf
        self.pos = 0
        self.name = name
        self.file_size = file_size
        self.limits = limits
        self.memo = memo

    def fail(self, what: str) -> GgufInvalid:
        return GgufInvalid(f"{self.name}: not a readable GGUF file ({what})")

    def short(self, end: int) -> InvalidGgufFile:
        if end > self.file_size or len(self.buf) >= self.file_size:
            return self.fail(f"header ends early at byte {self.pos}")
        return GgufTruncated(f"{self.name}: the header goes on past byte {len(self.buf)}", end)

    def scalar(self, fmt: struct.Struct) -> Any:
        end = self.pos + fmt.size
        if end > len(self.buf):
            raise self.short(end)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos = end
        return value

    def skip(self, n: int) -> int:
        """Step over ``n`` bytes; returns where they start."""
        start, end = self.pos, self.pos + n
        if end > len(self.buf):
            raise self.short(end)
        self.pos = end
        return start

    def text(self, max_bytes: int, what: str) -> bytes:
        n = self.scalar(_U64)
        if n > max_bytes:
            raise self.fail(f"{what} is {n:,} bytes long; at most {max_bytes:,} are allowed")
        start = self.skip(n)
        return bytes(self.buf[start : self.pos])

    def name_text(self, max_bytes: int, what: str) -> str:
        raw = self.text(max_bytes, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {self.pos - len(raw)} is not UTF-8") from exc

    def count(self, what: str, cap: int, min_item_bytes: int) -> int:
        n = self.scalar(_U64)
        room = (self.file_size - self.pos) // min_item_bytes
        if n > cap or n > room:
            raise self.fail(f"{what} claims {n:,} items; at most {min(cap, room):,} fit")
        return n

    # --- the parts of a header ----------------------------------------------------------------

    def header(self) -> GgufHeader:
        if self.file_size < 24:
            raise GgufInvalid(f"{self.name}: not a GGUF file (only {self.file_size} bytes)")
        if self.scalar(_U32) != GGUF_MAGIC:
            raise GgufInvalid(f"{self.name}: not a GGUF file (bad magic number)")
        version = self.scalar(_U32)
        if version not in (2, 3) and version and version & 0xFFFF == 0:
            raise GgufInvalid(f"{self.name}: the GGUF file was written for a big-endian "
                              "machine; llama.cpp reads only little-endian files")
        if version not in (2, 3):
            raise GgufInvalid(
                f"{self.name}: GGUF version {version} is not supported (only 2 and 3)")
        limits = self.limits
        tensor_count = self.count("the tensor table", limits.max_tensor_count, _MIN_TENSOR_BYTES)
        kv_count = self.count("the metadata", limits.max_kv_count, _MIN_KV_BYTES)
        header = GgufHeader(version=version, metadata={}, file_size=self.file_size)
        for _ in range(kv_count):
            self.key_value(header)
        for _ in range(tensor_count):
            header.tensors.append(self.tensor())
        alignment = header.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            raise self.fail(f"general.alignment is {alignment!r}")
        header.alignment = alignment
        header.header_bytes = self.pos
        header.data_start = -(-self.pos // alignment) * alignment
        return header

    def key_value(self, header: GgufHeader) -> None:
        key = self.name_text(self.limits.max_key_bytes, "a metadata key")
        if key in header.value_types:
            raise self.fail(f"the metadata key {key!r} appears twice")
        vtype = self.scalar(_U32)
        header.value_types[key] = vtype
        if vtype == GGUF_TYPE_ARRAY:
            header.metadata[key] = self.array(key, header)
        else:
            header.metadata[key] = self.value(vtype, key)

    def value(self, vtype: int, key: str) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.scalar(fmt)
        if vtype == GGUF_TYPE_STRING:
            raw = self.text(self.limits.max_string_bytes, f"the string {key!r}")
            return raw.decode("utf-8", errors="replace")
        if vtype == GGUF_TYPE_ARRAY:
            raise self.fail(f"{key!r} is an array of arrays, which llama.cpp does not read")
        raise self.fail(f"unknown value type {vtype} for {key!r}")

    def array(self, key: str, header: GgufHeader) -> list[Any] | None:
        item_type = self.scalar(_U32)
        header.array_types[key] = item_type
        fmt = _SCALARS.get(item_type)
        if fmt is None and item_type != GGUF_TYPE_STRING:
            self.value(item_type, key)  # raises: nested or unknown
        width = fmt.size if fmt is not None else 8
        count = self.count(f"the array {key!r}", self.limits.max_array_items, width)
        header.array_lengths[key] = count
        if count <= KEEP_ARRAY_ITEMS:
            return [self.value(item_type, key) for _ in range(count)]
        if fmt is not None:
            self.skip(count * width)
        else:
            self.skip_strings(count, key)
        return None

    def skip_strings(self, count: int, key: str) -> None:
        buf, pos, max_len = self.buf, self.pos, self.limits.max_string_bytes
        memo = self.memo
        if memo is not None:
            end = memo.end_of(buf, pos, count, max_len)
            if end is not None:
                self.pos = end
                return
        unpack, limit = _U64.unpack_from, len(buf) - 8
        start = pos
        for _ in range(count):
            if pos > limit:
                raise self.short(pos + 8)
            (n,) = unpack(buf, pos)
            if n > max_len:
                raise self.fail(f"a string in {key!r} at byte {pos} is {n:,} bytes long; "
                                f"at most {max_len:,} are allowed")
            pos += 8 + n
        if pos > len(buf):
            self.pos = start
            raise self.short(pos)
        self.pos = pos
        if memo is not None:
            memo.remember(buf, start, count, max_len, pos)

    def tensor(self) -> GgufTensor:
        name = self.name_text(self.limits.max_tensor_name_bytes, "a tensor name")
        n_dims = self.scalar(_U32)
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions; "
                            f"ggml allows 1 to {GGML_MAX_DIMS}")
        shape = tuple(self.scalar(_U64) for _ in range(n_dims))
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        ggml_type = self.scalar(_U32)
        offset = self.scalar(_U64)
        return GgufTensor(name, n_elements, ggml_type, offset, shape)
