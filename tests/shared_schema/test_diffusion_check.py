"""The checks a diffusion model file passes before stable-diffusion.cpp may open it
(``diffusion_check``) and its family by sd.cpp's own rules (``diffusion_family``): the real test
model reads right, in milliseconds; an LLM's GGUF is told apart; truncated files, garbage,
pickles and safetensors headers that lie (offsets past the file, overlaps, sizes, JSON of the
wrong types, repeated names, an oversized header) are each refused with a message naming the
fault, reading no more than the bound."""

from __future__ import annotations

import io
import json
import struct
import time
from typing import Any

import pytest

from shared_schema.diffusion_check import (
    DiffusionLimits,
    diffusion_shape_of_prefix,
    model_file_kind,
    read_diffusion_shape,
)
from shared_schema.diffusion_family import RENDERED_FAMILIES, sd_family
from shared_schema.errors import (
    GgufTruncated,
    InvalidDiffusionModel,
    NotADiffusionModel,
    UnsupportedDiffusionFamily,
)
from tests.support.diffusion_fixture import diffusion_model  # noqa: F401  (a fixture)
from tests.support.diffusion_models import WrittenModel, sdxs_tensors
from tests.support.gguf_mutants import SMOLLM2, gguf_bytes, kv

F32, Q4_1 = 0, 3
STRING = 8
UNET = "model.diffusion_model."
TOKENS = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
SD1_TABLE = [  # (name, torch shape) of an SD 1.x checkpoint, the few tensors that decide
    (f"{UNET}input_blocks.0.0.weight", [320, 4, 3, 3]),
    (f"{UNET}middle_block.1.norm.weight", [1280]),
    (TOKENS, [49408, 768]),
    ("first_stage_model.decoder.conv_in.weight", [512, 4, 3, 3]),
]


class CountingReader(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        self.bytes_read += len(data)
        return data


def safetensors(entries: dict[str, Any], data_bytes: int | None = None) -> bytes:
    """A safetensors file of ``entries`` (name: dtype, shape and data_offsets, as given),
    followed by ``data_bytes`` bytes (by default exactly what the offsets span)."""
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    if data_bytes is None:
        data_bytes = max((e["data_offsets"][1] for k, e in entries.items()
                          if k != "__metadata__"), default=0)
    return struct.pack("<Q", len(header)) + header + bytes(data_bytes)


def table(tensors: list[tuple[str, list[int]]], dtype: str = "F16") -> dict[str, Any]:
    """Safetensors entries laid end to end."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors:
        size = 2
        for dim in shape:
            size *= dim
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return entries


def shape_of(data: bytes, **kwargs: Any) -> Any:
    return read_diffusion_shape(io.BytesIO(data), "m.safetensors", **kwargs)


def refused(data: bytes, match: str, error: type[Exception] = InvalidDiffusionModel) -> None:
    with pytest.raises(error, match=match):
        shape_of(data)


# --- the real files --------------------------------------------------------------------------


def test_the_test_model_reads_as_sdxs_in_milliseconds(
        diffusion_model: WrittenModel) -> None:  # noqa: F811
    started = time.perf_counter()
    with diffusion_model.path.open("rb") as handle:
        shape = read_diffusion_shape(handle, diffusion_model.path.name)
    elapsed = time.perf_counter() - started

    assert shape.family == "sdxs"
    assert shape.file_format == "gguf"
    assert shape.parameter_count == diffusion_model.parameter_count
    unet = sum(_count(s.shape) for s in sdxs_tensors() if s.name.startswith(UNET))
    assert shape.denoiser_parameter_count == unet
    assert shape.text_encoder_parameter_count == 123_060_480  # CLIP-L's text model
    assert shape.has_vae
    assert shape.has_text_encoder
    assert not shape.diffusion_only
    assert shape.missing_parts == ()
    assert shape.native_side == 512
    assert shape.tensor_count == len(sdxs_tensors())
    assert shape.file_size == diffusion_model.size_bytes
    assert elapsed < 0.5, f"reading the header took {elapsed:.3f} s"
    with diffusion_model.path.open("rb") as handle:
        assert model_file_kind(handle, "m.gguf") == "diffusion"


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def test_an_llm_gguf_is_told_apart_and_refused_as_a_diffusion_model() -> None:
    with SMOLLM2.open("rb") as handle:
        assert model_file_kind(handle, SMOLLM2.name) == "llm"
    with SMOLLM2.open("rb") as handle, pytest.raises(NotADiffusionModel, match=r"LLM.*llama"):
        read_diffusion_shape(handle, SMOLLM2.name)


def test_a_truncated_model_is_refused(diffusion_model: WrittenModel) -> None:  # noqa: F811
    with diffusion_model.path.open("rb") as handle:
        start = handle.read(4 << 20)  # the header and the first tensors' data, not the rest
    with pytest.raises(InvalidDiffusionModel, match="truncated"):
        read_diffusion_shape(io.BytesIO(start), "cut.gguf")


@pytest.mark.parametrize(("data", "match"), [
    (b"", "only 0 bytes"),
    (b"\x00" * 7, "only 7 bytes"),
    (bytes(range(256)) * 64, "a header of .* bytes; 2 to"),
    (b"\x80\x02}q\x00(X\x05\x00\x00\x00model" + bytes(64), "a header of"),  # a pickle
    (b"GGUF" + bytes(60), "not a GGUF file|GGUF version"),
    (struct.pack("<Q", 4) + b"[1] " + bytes(8), "not a JSON object"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}" + bytes(8), "not JSON"),
    (struct.pack("<Q", 8) + b"[" * 8 + bytes(8), "not JSON"),
])
def test_garbage_is_refused(data: bytes, match: str) -> None:
    refused(data, match)


# --- safetensors -------------------------------------------------------------------------------


def test_a_safetensors_sd1_checkpoint_reads_as_sd1() -> None:
    entries = table(SD1_TABLE)
    entries["__metadata__"] = {"format": "pt"}
    shape = shape_of(safetensors(entries))
    assert shape.family == "sd1"
    assert shape.file_format == "safetensors"
    assert shape.native_side == 512
    assert shape.parameter_count == sum(_count(tuple(s)) for _, s in SD1_TABLE)
    assert shape.has_vae
    assert shape.has_text_encoder


def test_a_header_lying_about_offsets_is_refused() -> None:
    entries = table(SD1_TABLE)
    data = safetensors(entries)
    refused(data[:-1], "data ends at byte .* \\(the file is truncated or the offsets lie\\)")
    far = dict(entries)
    last = f"{UNET}input_blocks.0.0.weight"
    far[last] = {**far[last], "data_offsets": [10**12, 10**12 + 320 * 4 * 9 * 2]}
    refused(safetensors(far, data_bytes=len(data)), "offsets lie")


def test_overlapping_tensors_are_refused() -> None:
    entries = table(SD1_TABLE)
    tokens = entries[TOKENS]
    begin = tokens["data_offsets"][0] - 2
    entries[TOKENS] = {**tokens, "data_offsets": [begin, begin + 49408 * 768 * 2]}
    refused(safetensors(entries, data_bytes=10**8), "overlaps")


@pytest.mark.parametrize(("entry", "match"), [
    ({"dtype": "F16", "shape": [4], "data_offsets": [0, 6]}, "span 6 bytes, but .* has 8"),
    ({"dtype": "I16", "shape": [4], "data_offsets": [0, 8]}, "dtype 'I16' is not one"),
    ({"dtype": 7, "shape": [4], "data_offsets": [0, 8]}, "dtype '7' is not one"),
    ({"dtype": "F16", "shape": "4", "data_offsets": [0, 8]}, "shape must be a list"),
    ({"dtype": "F16", "shape": [0, 4], "data_offsets": [0, 0]}, "each at least 1"),
    ({"dtype": "F16", "shape": [1] * 6, "data_offsets": [0, 2]}, "at most 5 dimensions"),
    ({"dtype": "F16", "shape": [True], "data_offsets": [0, 2]}, "shape must be a list"),
    ({"dtype": "F16", "shape": [4], "data_offsets": "0-8"}, "two integers"),
    ({"dtype": "F16", "shape": [4], "data_offsets": [8, 0]}, "out of range"),
    ({"dtype": "F16", "shape": [4], "data_offsets": [0, 8], "extra": 1}, "not an object of"),
    ([1, 2], "not an object of"),
])
def test_a_tensor_entry_sd_cpp_would_misread_is_refused(entry: Any, match: str) -> None:
    """sd.cpp's reader aborts the process on a field of the wrong JSON type, and trusts sizes:
    each is refused here first."""
    entries: dict[str, Any] = table(SD1_TABLE)
    entries["odd.weight"] = entry
    refused(safetensors(entries, data_bytes=10**8), match)


def test_repeated_names_and_bad_metadata_are_refused() -> None:
    entry = '{"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}'
    header = f'{{"a.weight": {entry}, "a.weight": {entry}}}'.encode()
    refused(struct.pack("<Q", len(header)) + header + bytes(8), "'a.weight' appears twice")
    entries = table(SD1_TABLE)
    entries["__metadata__"] = {"format": 1}
    refused(safetensors(entries), "__metadata__ is not an object of strings")


def test_an_oversized_header_is_refused_before_it_is_read() -> None:
    claim = struct.pack("<Q", 200_000_000) + b"{" + bytes(1000)
    reader = CountingReader(claim)
    with pytest.raises(InvalidDiffusionModel, match="a header of 200,000,000 bytes; 2 to "
                                                    "16,777,216 are allowed"):
        read_diffusion_shape(reader, "big.safetensors")
    assert reader.bytes_read <= 8 + 4

    header = json.dumps(table(SD1_TABLE)).encode()
    small = DiffusionLimits(max_header_bytes=len(header) - 1)
    data = struct.pack("<Q", len(header)) + header + bytes(10**7)
    with pytest.raises(InvalidDiffusionModel, match="are allowed"):
        shape_of(data, limits=small)
    refused(struct.pack("<Q", 5000) + b"{}" + bytes(100), "runs past the end of the file")


def test_too_many_tensors_are_refused() -> None:
    many = table([(f"t{i}.weight", [1]) for i in range(20)])
    with pytest.raises(InvalidDiffusionModel, match="at most 10 are allowed"):
        shape_of(safetensors(many), limits=DiffusionLimits(max_tensor_count=10))


# --- GGUF ---------------------------------------------------------------------------------------


def gguf_table(tensors: list[tuple[str, tuple[int, ...]]], kind: int = F32) -> bytes:
    """A GGUF file of F32 tensors laid end to end (shapes in ggml's order)."""
    entries, offset = [], 0
    for name, shape in tensors:
        entries.append((name, shape, kind, offset))
        offset += -(-_count(shape) * 4 // 32) * 32
    return gguf_bytes([kv("general.architecture", STRING, "flux")], entries, offset)


def test_a_lone_flux_transformer_is_a_diffusion_model_missing_its_parts() -> None:
    data = gguf_table([("double_blocks.0.img_attn.norm.key_norm.scale", (128,)),
                       ("img_in.weight", (64, 8))])
    shape = read_diffusion_shape(io.BytesIO(data), "flux1-dev-Q4_0.gguf")
    assert shape.family == "flux"
    assert shape.diffusion_only
    assert shape.missing_parts == ("text encoder", "VAE")
    assert model_file_kind(io.BytesIO(data), "flux.gguf") == "diffusion"


def test_a_gguf_tensor_type_sd_cpp_does_not_know_is_refused() -> None:
    data = gguf_bytes([], [(f"{UNET}input_blocks.0.0.weight", (128,), 41, 0)], 32)
    with pytest.raises(InvalidDiffusionModel, match=r"ggml type 41 .* does not read"):
        read_diffusion_shape(io.BytesIO(data), "m.gguf")


def test_gguf_names_past_127_bytes_are_refused() -> None:
    data = gguf_table([(UNET + "x" * 110, (8,))])
    with pytest.raises(InvalidDiffusionModel, match="at most 127"):
        read_diffusion_shape(io.BytesIO(data), "m.gguf")


# --- families, by sd.cpp's rules ------------------------------------------------------------------


def ggml(tensors: list[tuple[str, list[int]]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(reversed(shape))) for name, shape in tensors]


@pytest.mark.parametrize(("tensors", "family"), [
    (SD1_TABLE, "sd1"),
    ([(f"{UNET}input_blocks.0.0.weight", [320, 9, 3, 3]), *SD1_TABLE[1:]], "sd1_inpaint"),
    ([(f"{UNET}input_blocks.0.0.weight", [320, 8, 3, 3]), *SD1_TABLE[1:]], "sd1_pix2pix"),
    ([SD1_TABLE[0], SD1_TABLE[2], (f"{UNET}output_blocks.7.1.norm.weight", [320])],
     "sd1_tiny"),
    ([SD1_TABLE[0], SD1_TABLE[2]], "sdxs"),
    ([SD1_TABLE[0], SD1_TABLE[1], ("cond_stage_model.model.token_embedding.weight",
                                   [49408, 1024])], "sd2"),
    ([("conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight",
       [49408, 768]), ("conditioner.embedders.1.model.ln_final.weight", [1280]),
      *SD1_TABLE[:2]], "sdxl"),
    ([("conditioner.embedders.1.model.ln_final.weight", [1280]), SD1_TABLE[0]], "sdxl_vega"),
    ([(f"{UNET}joint_blocks.0.x_block.attn.qkv.weight", [4608, 1536]), *SD1_TABLE], "sd3"),
    ([(f"{UNET}double_blocks.0.img_mod.lin.weight", [18432, 3072])], "flux"),
    ([(f"{UNET}double_blocks.0.img_mod.lin.weight", [18432, 3072]),
      (f"{UNET}img_in.weight", [3072, 384])], "flux_fill"),
    ([(f"{UNET}input_blocks.8.0.time_mixer.mix_factor", [1]), *SD1_TABLE], "svd"),
    ([(f"{UNET}blocks.0.cross_attn.norm_k.weight", [5120])], "wan2"),
    ([("first_stage_model.decoder.conv_in.weight", [512, 4, 3, 3])], None),
    ([("token_embd.weight", [49152, 576]), ("blk.0.attn_q.weight", [576, 576])], None),
])
def test_families_follow_sd_cpps_rules(tensors: list[tuple[str, list[int]]],
                                       family: str | None) -> None:
    assert sd_family(ggml(tensors)) == family


def test_the_first_settling_tensor_wins_as_in_sd_cpp() -> None:
    sd3 = (f"{UNET}joint_blocks.0.x_block.attn.qkv.weight", [4608, 1536])
    flux_only = (f"{UNET}nerf_final_layer_conv.weight", [3, 64, 3, 3])
    assert sd_family(ggml([sd3, flux_only])) == "sd3"
    assert sd_family(ggml([flux_only, sd3])) == "chroma_radiance"


@pytest.mark.parametrize("family", ["sd1_inpaint", "svd", "wan2", "flux_fill"])
def test_a_family_not_rendered_from_a_prompt_is_refused(family: str) -> None:
    tables = {
        "sd1_inpaint": [(f"{UNET}input_blocks.0.0.weight", [320, 9, 3, 3]), *SD1_TABLE[1:]],
        "svd": [(f"{UNET}input_blocks.8.0.time_mixer.mix_factor", [1]), *SD1_TABLE],
        "wan2": [(f"{UNET}blocks.0.cross_attn.norm_k.weight", [16])],
        "flux_fill": [(f"{UNET}double_blocks.0.img_mod.lin.weight", [16, 8]),
                      (f"{UNET}img_in.weight", [8, 384])],
    }
    assert family not in RENDERED_FAMILIES
    with pytest.raises(UnsupportedDiffusionFamily, match=f"a {family} model") as caught:
        shape_of(safetensors(table(tables[family])))
    assert caught.value.family == family


def test_safetensors_names_are_walked_sorted_as_sd_cpp_keeps_them() -> None:
    """sd.cpp's JSON objects sort their keys, so in a safetensors file the first settling
    tensor is the first by name, whatever the header's order."""
    sd3 = (f"{UNET}joint_blocks.0.x.weight", [4])
    radiance = (f"{UNET}nerf_final_layer_conv.weight", [4])
    for order in ([sd3, radiance], [radiance, sd3]):
        assert shape_of(safetensors(table(order))).family == "sd3"


def test_a_safetensors_prefix_says_how_far_to_read_then_gives_the_shape() -> None:
    """As the queen reads a hub file: the first bytes, then as far as the header says."""
    data = safetensors(table(SD1_TABLE))
    (header_bytes,) = struct.unpack_from("<Q", data)
    with pytest.raises(GgufTruncated) as caught:
        diffusion_shape_of_prefix(data[:64], "m.safetensors", len(data))
    assert caught.value.needed == 8 + header_bytes
    shape = diffusion_shape_of_prefix(data[:8 + header_bytes], "m.safetensors", len(data))
    assert (shape.family, shape.file_format, shape.file_size) == ("sd1", "safetensors",
                                                                  len(data))
    assert shape.incomplete("m.safetensors") is None
    lying = struct.pack("<Q", 20 << 20) + data[8:64]  # a 20 MiB header is refused, not read
    with pytest.raises(InvalidDiffusionModel, match="16,777,216 are allowed"):
        diffusion_shape_of_prefix(lying, "m.safetensors", 1 << 30)
    no_vae = table([entry for entry in SD1_TABLE if not entry[0].startswith("first_stage")])
    short = safetensors(no_vae)
    assert "without its VAE" in (diffusion_shape_of_prefix(short, "m.safetensors", len(short))
                                 .incomplete("m.safetensors") or "")
