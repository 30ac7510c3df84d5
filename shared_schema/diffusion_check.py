"""A diffusion model file's header, checked before stable-diffusion.cpp may open it, and what it
says about the model (``DiffusionShape``).

The worker's store runs it on every import and download, the engine child again right before a
load (``desktop_worker.engine.diffusion``), and the queen prices a model by it (its family and
parameter count). Two formats are read, both from a seekable binary file object, headers only:

- GGUF, through ``shared_schema.gguf_check`` (every count, length, type, offset and overlap);
  tensor names may be up to 127 bytes (sd.cpp's ggml is built with ``GGML_MAX_NAME=128``,
  and diffusion tensors' names pass 64 bytes), and only types sd.cpp 0.4.7's ggml knows;
- safetensors: an 8-byte little-endian header length (at most ``max_header_bytes``, safetensors'
  own bound), then a JSON object of tensors, each a known ``dtype``, a ``shape`` of positive
  integers, and ``data_offsets`` whose span is exactly the tensor's bytes, inside the file and
  overlapping no other tensor. sd.cpp's reader checks none of the bounds (a header lying about
  its offsets has it read past the end of the file) and aborts the process on a field of the
  wrong JSON type; this refuses both first. Repeated names are refused.

Anything else (a pickled checkpoint, which sd.cpp would also open, a directory) is refused.
The family follows sd.cpp's own detection (``diffusion_family.sd_family``); a file whose names
carry no part prefix (a lone FLUX or SD3 transformer, as published for use with separate text
encoders) is read as sd.cpp reads a ``diffusion_model_path`` file, with
``model.diffusion_model.`` added: its shape says ``diffusion_only``. Errors: ``NotADiffusionModel``
(no family), ``UnsupportedDiffusionFamily`` (a family not rendered from a prompt), else
``InvalidDiffusionModel``, each naming the file and what is wrong.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Literal

from shared_schema.diffusion_family import (
    DENOISER_PREFIXES,
    TEXT_ENCODER_PREFIXES,
    VAE_PREFIXES,
    model_parts,
    native_side,
    sd_family,
)
from shared_schema.errors import (
    GgufTruncated,
    InvalidDiffusionModel,
    InvalidGgufFile,
    NotADiffusionModel,
    UnsupportedDiffusionFamily,
)
from shared_schema.gguf import GGUF_MAGIC, GgufLimits, parse_gguf_header
from shared_schema.gguf_check import GGML_TYPES, SeekableReader, check_gguf_file

__all__ = [
    "DIFFUSION_ARCHITECTURE",
    "DIFFUSION_GGUF_LIMITS",
    "SAFETENSORS_DTYPES",
    "DiffusionLimits",
    "DiffusionShape",
    "ModelKind",
    "diffusion_shape_of_prefix",
    "model_file_kind",
    "read_diffusion_shape",
]

FileFormat = Literal["gguf", "safetensors"]
# The architecture both sides record for a diffusion model, before its family: "diffusion:sdxs".
DIFFUSION_ARCHITECTURE = "diffusion:"
ModelKind = Literal["llm", "diffusion"]

DIFFUSION_GGUF_LIMITS = GgufLimits(max_tensor_name_bytes=127)
SD_GGML_TYPES = frozenset(t for t in GGML_TYPES if t <= 40)  # sd.cpp 0.4.7's ggml: F32..NVFP4
# The safetensors dtypes sd.cpp reads, with their bytes per element (U8 tensors it skips).
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                      "I64": 8, "I32": 4, "U8": 1}
_SD_MAX_DIMS = 5
_INT64_MAX = (1 << 63) - 1
_U64 = struct.Struct("<Q")
_BARE_PREFIX = "model.diffusion_model."


@dataclass(frozen=True, slots=True)
class DiffusionLimits:
    """Bounds on a safetensors header (GGUF files use ``DIFFUSION_GGUF_LIMITS``)."""

    # The safetensors library allows 100 MB; real headers are far smaller (an entry is about
    # 120 bytes, and SDXL's single file has about 2,500 tensors: 300 KB), and the worker
    # parses this JSON in its own process.
    max_header_bytes: int = 16 << 20
    max_tensor_count: int = 1 << 16
    max_name_bytes: int = 255


@dataclass(frozen=True, slots=True)
class DiffusionShape:
    """What a diffusion model file is, by its header alone."""

    family: str  # sd.cpp's detection, as named in ``diffusion_family``
    file_format: FileFormat
    parameter_count: int  # every tensor's elements
    denoiser_parameter_count: int  # the UNet's or transformer's
    text_encoder_parameter_count: int
    has_vae: bool
    has_text_encoder: bool
    diffusion_only: bool  # tensor names without a part prefix (a lone transformer)
    native_side: int
    tensor_count: int
    file_size: int

    @property
    def missing_parts(self) -> tuple[str, ...]:
        """What sd.cpp needs besides this file to render (Apiary loads one file a model)."""
        missing = []
        if not self.has_text_encoder:
            missing.append("text encoder")
        if not self.has_vae:
            missing.append("VAE")
        return tuple(missing)

    def incomplete(self, name: str) -> str | None:
        """Why this file alone cannot render (None: it can): Apiary loads one file a model,
        so a lone denoiser, or a model without its text encoder or VAE, is of no use."""
        if not self.missing_parts and not self.diffusion_only:
            return None
        return (f"{name} is a {self.family} model without its "
                f"{' and '.join(self.missing_parts) or 'text encoder and VAE'}: Apiary serves a "
                "diffusion model from one file that holds all its parts")


@dataclass(frozen=True, slots=True)
class _Table:
    """A header's tensors: names and ggml shapes in sd.cpp's order, element counts."""

    file_format: FileFormat
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    file_size: int
    llm_architecture: str | None = None


def read_diffusion_shape(handle: SeekableReader, name: str, *,
                         limits: DiffusionLimits | None = None) -> DiffusionShape:
    """Check the file's header and say what model it is; refuses anything sd.cpp should not
    open or Apiary does not render (see the module's words)."""
    table = _read_table(handle, name, limits or DiffusionLimits())
    return _shape(table, name)


def model_file_kind(handle: SeekableReader, name: str, *,
                    limits: DiffusionLimits | None = None) -> ModelKind:
    """Whether a model file is an LLM's GGUF (llama.cpp's: ``general.architecture`` and its
    ``token_embd``/``blk.N`` tensors) or a diffusion model of any family sd.cpp detects.
    ``InvalidDiffusionModel`` for a file that is neither or cannot be read; an LLM's file is
    only told apart here: ``gguf_check`` is what checks it for llama.cpp."""
    table = _read_table(handle, name, limits or DiffusionLimits())
    if _family(table)[0] is not None:
        return "diffusion"
    if table.llm_architecture is not None and any(
            n == "token_embd.weight" or n.startswith("blk.") for n in table.names):
        return "llm"
    raise NotADiffusionModel(f"{name}: neither a diffusion model stable-diffusion.cpp knows "
                             "nor an LLM's GGUF")


# --- the shape -----------------------------------------------------------------------------------


def _family(table: _Table) -> tuple[str | None, bool]:
    """The family, and whether it was found only with ``model.diffusion_model.`` added."""
    family = sd_family(zip(table.names, table.shapes, strict=True))
    if family is not None:
        return family, False
    prefixes = DENOISER_PREFIXES + TEXT_ENCODER_PREFIXES + VAE_PREFIXES
    if any(n.startswith(prefixes) for n in table.names):
        return None, False
    bare = sd_family(zip((_BARE_PREFIX + n for n in table.names), table.shapes, strict=True))
    return bare, bare is not None


def _shape(table: _Table, name: str) -> DiffusionShape:
    family, bare = _family(table)
    if family is None:
        what = f"an LLM's GGUF ({table.llm_architecture})" if table.llm_architecture else \
            "not a diffusion model"
        raise NotADiffusionModel(f"{name}: {what}: stable-diffusion.cpp recognises no model "
                                 "in its tensors")
    side = native_side(family)
    if side is None:
        raise UnsupportedDiffusionFamily(
            f"{name}: a {family} model: Apiary renders images from a prompt with SD 1.x, SD 2.x, "
            "SDXL, SD3 and FLUX models only", family)
    if bare:
        parts = model_parts((_BARE_PREFIX + n, c) for n, c in zip(table.names, table.counts,
                                                                  strict=True))
    else:
        parts = model_parts(zip(table.names, table.counts, strict=True))
    return DiffusionShape(
        family=family,
        file_format=table.file_format,
        parameter_count=parts.total,
        denoiser_parameter_count=parts.denoiser,
        text_encoder_parameter_count=parts.text_encoder,
        has_vae=parts.vae > 0,
        has_text_encoder=parts.text_encoder > 0,
        diffusion_only=bare,
        native_side=side,
        tensor_count=len(table.names),
        file_size=table.file_size,
    )


def diffusion_shape_of_prefix(data: bytes, name: str, file_size: int) -> DiffusionShape:
    """A diffusion model's shape from the first bytes of its file (``file_size`` in all), as
    the queen reads a hub file with a range request (issue 38: priced by its own reading): a
    GGUF file, or else a safetensors file. ``GgufTruncated`` when the header runs past
    ``data`` (its ``needed`` says how far to read); ``InvalidDiffusionModel`` (and its kinds)
    otherwise. Only the header is read: a GGUF file's tensors' offsets are the worker's to
    check against the whole file (a safetensors header's are checked here, against
    ``file_size``)."""
    if len(data) < 4 or int.from_bytes(data[:4], "little") != GGUF_MAGIC:
        return _safetensors_prefix_shape(data, name, file_size)
    try:
        header = parse_gguf_header(data, name, file_size, limits=DIFFUSION_GGUF_LIMITS)
    except GgufTruncated:
        raise
    except InvalidGgufFile as exc:
        raise InvalidDiffusionModel(str(exc)) from exc
    arch = header.metadata.get("general.architecture")
    return _shape(_Table(
        file_format="gguf", names=tuple(t.name for t in header.tensors),
        shapes=tuple(t.shape for t in header.tensors),
        counts=tuple(t.n_elements for t in header.tensors), file_size=file_size,
        llm_architecture=arch if isinstance(arch, str) and arch else None), name)


def _safetensors_prefix_shape(data: bytes, name: str, file_size: int) -> DiffusionShape:
    limits = DiffusionLimits()
    if len(data) >= 8 and len(data) < file_size:
        (header_bytes,) = _U64.unpack_from(data)
        needed = 8 + header_bytes
        if header_bytes <= limits.max_header_bytes and len(data) < needed <= file_size:
            raise GgufTruncated(f"{name}: its safetensors header runs past the {len(data):,} "
                                "bytes read", needed)
    return _shape(_safetensors_table(io.BytesIO(data), name, file_size, limits), name)


# --- reading the header --------------------------------------------------------------------------


def _read_table(handle: SeekableReader, name: str, limits: DiffusionLimits) -> _Table:
    try:
        file_size = handle.seek(0, os.SEEK_END)
        handle.seek(0)
        magic = handle.read(4)
    except OSError as exc:
        raise InvalidDiffusionModel(f"{name}: cannot be read ({exc})") from exc
    if len(magic) == 4 and int.from_bytes(magic, "little") == GGUF_MAGIC:
        return _gguf_table(handle, name)
    return _safetensors_table(handle, name, file_size, limits)


def _gguf_table(handle: SeekableReader, name: str) -> _Table:
    try:
        header = check_gguf_file(handle, name, limits=DIFFUSION_GGUF_LIMITS)
    except InvalidGgufFile as exc:
        raise InvalidDiffusionModel(str(exc)) from exc
    except OSError as exc:
        raise InvalidDiffusionModel(f"{name}: cannot be read ({exc})") from exc
    for tensor in header.tensors:
        if tensor.ggml_type not in SD_GGML_TYPES:
            raise InvalidDiffusionModel(
                f"{name}: tensor {tensor.name!r} is of ggml type {tensor.ggml_type} "
                f"({GGML_TYPES[tensor.ggml_type].name}), which stable-diffusion.cpp does not read")
    arch = header.metadata.get("general.architecture")
    return _Table(
        file_format="gguf",
        names=tuple(t.name for t in header.tensors),
        shapes=tuple(t.shape for t in header.tensors),
        counts=tuple(t.n_elements for t in header.tensors),
        file_size=header.file_size,
        llm_architecture=arch if isinstance(arch, str) and arch else None,
    )


def _safetensors_table(handle: SeekableReader, name: str, file_size: int,
                       limits: DiffusionLimits) -> _Table:
    def bad(what: str) -> InvalidDiffusionModel:
        return InvalidDiffusionModel(f"{name}: not a readable safetensors file ({what})")

    if file_size < 8 + 2:
        raise bad(f"only {file_size} bytes")
    try:
        handle.seek(0)
        (header_bytes,) = _U64.unpack(handle.read(8))
        if header_bytes < 2 or header_bytes > limits.max_header_bytes:
            raise bad(f"a header of {header_bytes:,} bytes; 2 to {limits.max_header_bytes:,} "
                      "are allowed")
        if 8 + header_bytes > file_size:
            raise bad(f"the header of {header_bytes:,} bytes runs past the end of the file "
                      f"({file_size:,} bytes)")
        raw = handle.read(header_bytes)
    except OSError as exc:
        raise InvalidDiffusionModel(f"{name}: cannot be read ({exc})") from exc
    if len(raw) != header_bytes:
        raise bad("the file ended inside the header")
    entries = _parse_json(raw, bad)
    data_size = file_size - 8 - header_bytes
    return _tensor_table(entries, name, file_size, data_size, limits, bad)


def _parse_json(raw: bytes, bad: Any) -> list[tuple[str, Any]]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in items]
        if len(set(keys)) != len(keys):
            repeated = next(key for key in keys if keys.count(key) > 1)
            raise bad(f"the name {repeated[:80]!r} appears twice")
        return dict(items)

    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=pairs)
    except InvalidDiffusionModel:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"the header is not JSON: {str(exc)[:120]}") from exc
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    return list(header.items())


def _tensor_table(entries: list[tuple[str, Any]], name: str, file_size: int, data_size: int,
                  limits: DiffusionLimits, bad: Any) -> _Table:
    if len(entries) > limits.max_tensor_count + 1:
        raise bad(f"{len(entries):,} tensors; at most {limits.max_tensor_count:,} are allowed")
    spans: list[tuple[int, int, str]] = []
    table: list[tuple[str, tuple[int, ...], int]] = []
    for key, info in entries:
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("__metadata__ is not an object of strings")
            continue
        shape, count, nbytes, begin = _entry(key, info, data_size, limits, bad)
        if nbytes:
            spans.append((begin, begin + nbytes, key))
        if info["dtype"] != "U8":  # sd.cpp skips U8 tensors
            table.append((key, tuple(reversed(shape)), count))
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise bad(f"tensor {second!r} overlaps tensor {first!r}")
    table.sort(key=lambda item: item[0])  # sd.cpp's JSON objects keep their keys sorted
    return _Table(file_format="safetensors", names=tuple(t[0] for t in table),
                  shapes=tuple(t[1] for t in table), counts=tuple(t[2] for t in table),
                  file_size=file_size)


def _entry(key: str, info: Any, data_size: int, limits: DiffusionLimits, bad: Any
           ) -> tuple[list[int], int, int, int]:
    """One tensor's shape, element count, bytes and first byte (in the data section)."""
    label = f"tensor {key[:80]!r}"
    if not key or len(key.encode("utf-8")) > limits.max_name_bytes or not key.isprintable():
        raise bad(f"{label}: a name must be printable, 1 to {limits.max_name_bytes} bytes")
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad(f"{label}: not an object of dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise bad(f"{label}: dtype {str(dtype)[:20]!r} is not one stable-diffusion.cpp reads")
    if (not isinstance(shape, list) or len(shape) > _SD_MAX_DIMS
            or not all(_is_int(d) and 1 <= d <= _INT64_MAX for d in shape)):
        raise bad(f"{label}: shape must be a list of at most {_SD_MAX_DIMS} dimensions, each "
                  "at least 1")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise bad(f"{label}: data_offsets must be two integers")
    count = 1
    for dim in shape:
        count *= dim
    nbytes = count * SAFETENSORS_DTYPES[dtype]
    begin, end = offsets
    if count > _INT64_MAX or not 0 <= begin <= end:
        raise bad(f"{label}: data_offsets {offsets} or shape {shape} out of range")
    if end - begin != nbytes:
        raise bad(f"{label}: data_offsets span {end - begin:,} bytes, but a {dtype} tensor of "
                  f"shape {shape} has {nbytes:,}")
    if end > data_size:
        raise bad(f"{label}: its data ends at byte {end:,} of a data section of "
                  f"{data_size:,} bytes (the file is truncated or the offsets lie)")
    return shape, count, nbytes, begin


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
