"""The checks a GGUF header passes before llama.cpp may open its file (``gguf_check``): the real
SmolLM2 file passes, fast; each rule refuses a small hand-built header that breaks it, with a
message naming what is wrong; the type table is the one of the llama.cpp build the worker ships;
a prefix asks for more bytes; a split model's parts must agree."""

from __future__ import annotations

import ctypes
import importlib.resources
import io
import struct
import time

import llama_cpp
import pytest
from gguf.constants import GGML_QUANT_SIZES

from shared_schema.errors import GgufInvalid, GgufTruncated
from shared_schema.gguf import GgufLimits, StringArrayMemo, parse_gguf_header
from shared_schema.gguf_check import (
    GGML_TYPES,
    check_gguf_file,
    check_gguf_header,
    check_split_parts,
)
from tests.support.gguf_mutants import SMOLLM2, gguf_bytes, kv, load_base, with_string

STRING, ARRAY, U8, I32, U32, F32, U64 = 8, 9, 0, 5, 4, 6, 10
F32_TYPE, Q4_1_TYPE = 0, 3
ARCH = kv("general.architecture", STRING, "llama")
ROW = [("a.weight", (8, 2), F32_TYPE, 0), ("b.weight", (8,), F32_TYPE, 64)]  # 64 + 32 bytes


def check(data: bytes, **kwargs: object) -> object:
    return check_gguf_header(data, "m.gguf", **kwargs)  # type: ignore[arg-type]


def refused(data: bytes, match: str, **kwargs: object) -> None:
    with pytest.raises(GgufInvalid, match=match):
        check(data, **kwargs)


# --- the real file ---------------------------------------------------------------------------


def test_the_real_model_passes_in_milliseconds() -> None:
    started = time.perf_counter()
    with SMOLLM2.open("rb") as handle:
        header = check_gguf_file(handle, SMOLLM2.name)
    elapsed = time.perf_counter() - started

    assert len(header.tensors) == 272
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49_152
    size = SMOLLM2.stat().st_size
    assert header.file_size == size
    data = sum(t.n_bytes or 0 for t in header.tensors)
    assert data == size - header.data_start  # SmolLM2's tensors fill the data section exactly
    assert elapsed < 0.5, f"checking the header took {elapsed:.3f} s"


def test_a_good_small_file_passes() -> None:
    header = check(gguf_bytes([ARCH], ROW, 96))
    assert [t.n_bytes for t in header.tensors] == [64, 32]  # type: ignore[attr-defined]


# --- the type table is this llama.cpp build's ------------------------------------------------


def test_type_table_is_the_shipped_libggml() -> None:
    lib = ctypes.CDLL(str(importlib.resources.files("llama_cpp") / "lib" / "libggml-base.so"))
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_blck_size.argtypes = [ctypes.c_int]
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_size.argtypes = [ctypes.c_int]
    known = {}
    for ggml_type in range(llama_cpp.GGML_TYPE_COUNT):  # ggml reads past its table beyond
        block = lib.ggml_blck_size(ggml_type)
        if block > 0:  # removed types have no block size: llama.cpp refuses them
            known[ggml_type] = (block, lib.ggml_type_size(ggml_type))
    assert {t: (k.block_size, k.type_size) for t, k in GGML_TYPES.items()} == known


def test_type_table_agrees_with_the_gguf_package() -> None:
    mine = {t: (k.block_size, k.type_size) for t, k in GGML_TYPES.items()}
    theirs = {int(quant): sizes for quant, sizes in GGML_QUANT_SIZES.items()}
    # gguf 0.19 counts Q8_1's block as 40 bytes (two floats); ggml stores two halves: 36. No
    # file holds Q8_1 (it is the CPU's scratch type); the library that reads files wins.
    assert theirs.pop(9) == (32, 40)
    assert mine.pop(9) == (32, 36)
    assert {t: mine[t] for t in theirs} == theirs
    assert set(mine) - set(theirs) == {42}  # Q2_0: newer than the gguf package
    for quant in GGML_QUANT_SIZES:
        assert GGML_TYPES[int(quant)].name == quant.name


# --- the header's walk -----------------------------------------------------------------------


@pytest.mark.parametrize(("data", "match"), [
    (b"GGML" + bytes(60), "bad magic"),
    (struct.pack("<II", 0x46554747, 1) + bytes(60), "version 1 is not supported"),
    (struct.pack("<II", 0x46554747, 4) + bytes(60), "version 4 is not supported"),
    (struct.pack("<I", 0x46554747) + struct.pack(">I", 3) + bytes(60), "big-endian"),
    (struct.pack("<IIQQ", 0x46554747, 3, 2**40, 0) + bytes(64), "tensor table claims"),
    (struct.pack("<IIQQ", 0x46554747, 3, 0, 2**17) + bytes(64), "metadata claims"),
])
def test_a_broken_start_is_refused(data: bytes, match: str) -> None:
    refused(data, match)


def test_metadata_walk_is_bounded() -> None:
    limits = GgufLimits()
    unknown = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 13) + bytes(8)
    refused(gguf_bytes([ARCH, unknown], []), "unknown value type 13")
    refused(gguf_bytes([ARCH, kv("nested", ARRAY, [], ARRAY)], []), "array of arrays")
    refused(gguf_bytes([ARCH, kv("s", STRING, "x" * (limits.max_string_bytes + 1))], []),
            "the string 's' is 1,048,577 bytes long")
    refused(gguf_bytes([ARCH, kv("k" * (limits.max_key_bytes + 1), U32, 1)], []),
            "a metadata key is 1,025 bytes long")
    refused(gguf_bytes([ARCH, kv("general.architecture", STRING, "qwen2")], []),
            "'general.architecture' appears twice")
    big = struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", ARRAY, U8, (1 << 22) + 1)
    refused(gguf_bytes([ARCH, big + bytes((1 << 22) + 1)], []), "claims 4,194,305 items")
    lying = struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", ARRAY, STRING, 1000)
    refused(gguf_bytes([ARCH, lying + bytes(100)], []), "claims 1,000 items")


def test_a_long_string_array_is_walked_and_bounded() -> None:
    tokens = [f"t{i}" for i in range(1000)]
    header = check(gguf_bytes([ARCH, kv("tokenizer.ggml.tokens", ARRAY, tokens, STRING)], []))
    assert header.array_lengths["tokenizer.ggml.tokens"] == 1000  # type: ignore[attr-defined]
    long = [*tokens[:500], "y" * 300, *tokens[500:]]
    refused(gguf_bytes([ARCH, kv("tokenizer.ggml.tokens", ARRAY, long, STRING)], []),
            "a string in 'tokenizer.ggml.tokens' at byte .* is 300 bytes long",
            limits=GgufLimits(max_string_bytes=100))


# --- the metadata llama.cpp reads ------------------------------------------------------------


@pytest.mark.parametrize(("kvs", "match"), [
    ([kv("general.alignment", U64, 32)], "general.alignment is a uint64, not a uint32"),
    ([kv("general.alignment", U32, 48)], "general.alignment 48 is not a power of two"),
    ([kv("general.alignment", U32, 0)], r"general.alignment is 0"),
    ([kv("general.name", U32, 1)], "general.name is a uint32; llama.cpp reads it as a string"),
    ([kv("tokenizer.chat_template", STRING, "{{ x }}" * 20_000)],
     "the chat template 'tokenizer.chat_template' is 140,000 bytes"),
    ([kv("tokenizer.chat_template.tool_use", STRING, "x" * (129 << 10))],
     "'tokenizer.chat_template.tool_use' is 132,096 bytes"),
    ([kv("tokenizer.chat_template", ARRAY, ["a"], STRING)], "chat_template is an array"),
    ([kv("tokenizer.ggml.tokens", ARRAY, [1, 2], U32)],
     "tokens is an array of uint32; llama.cpp reads it as an array of string"),
    ([kv("tokenizer.ggml.tokens", ARRAY, ["a", "b"], STRING),
      kv("tokenizer.ggml.scores", ARRAY, [0.5], F32)], "scores has 1 items for 2 tokens"),
    ([kv("tokenizer.ggml.tokens", ARRAY, ["a", "b"], STRING),
      kv("tokenizer.ggml.token_type", ARRAY, [1, 1], U8)],
     "token_type is an array of uint8; llama.cpp reads it as an array of int32"),
    ([kv("tokenizer.ggml.merges", STRING, "a b")],
     "merges is a string; llama.cpp reads it as an array of string"),
    ([kv("tokenizer.ggml.precompiled_charsmap", ARRAY, [1.0], F32)], "precompiled_charsmap"),
    ([kv("split.no", U32, 0)], "names both split.no and split.count"),
    ([kv("split.no", U32, 3), kv("split.count", U32, 3)], "split.no 3 and split.count 3"),
    ([kv("split.no", U32, 0), kv("split.count", STRING, "3")], "split.count is a string"),
    ([kv("split.no", U32, 0), kv("split.count", U32, 2), kv("split.tensors.count", I32, 1)],
     "split.tensors.count is 1, but this part alone holds 2"),
])
def test_metadata_llama_cpp_reads_is_checked(kvs: list[bytes], match: str) -> None:
    refused(gguf_bytes([ARCH, *kvs], ROW, 96), match)


def test_a_big_template_passes_under_a_raised_limit() -> None:
    data = gguf_bytes([ARCH, kv("tokenizer.chat_template", STRING, "x" * 200_000)], ROW, 96)
    refused(data, "chat template")
    check(data, limits=GgufLimits(max_chat_template_bytes=256 << 10))


# --- the tensor table ------------------------------------------------------------------------


@pytest.mark.parametrize(("tensors", "data_bytes", "match"), [
    ([("a", (8,), 4, 0)], 32, "tensor 'a': unknown ggml type 4"),
    ([("a", (8,), 43, 0)], 32, "tensor 'a': unknown ggml type 43"),
    ([("a", (8,), 2**32 - 1, 0)], 32, "unknown ggml type 4294967295"),
    ([("a", (8, 0), F32_TYPE, 0)], 32, r"shape \[8, 0\] has a dimension below 1"),
    ([("a", (2**63,), F32_TYPE, 0)], 32, "has a dimension below 1 or past a 64-bit"),
    ([("a", (2**32, 2**32), F32_TYPE, 0)], 32, "18,446,744,073,709,551,616 elements"),
    ([("a", (2**31, 2**31, 2), F32_TYPE, 0)], 32, "more than a 64-bit integer counts"),
    ([("a", (2**40, 2**22), 28, 0)], 32, "36,893,488,147,419,103,232 bytes is more than"),
    ([("a", (48,), Q4_1_TYPE, 0)], 64, "rows of 48 elements are not a whole number of Q4_1"),
    ([("a", (8,), F32_TYPE, 16)], 64, "tensor 'a': offset 16 is not aligned to 32"),
    ([("a", (8,), F32_TYPE, 2**64 - 32)], 64, "the file is truncated"),
    ([("a", (16,), F32_TYPE, 0)], 32, r"ends at byte \d+; the file has"),
    ([("a", (16,), F32_TYPE, 0), ("b", (8,), F32_TYPE, 32)], 96,
     "tensor 'b' .offset 32. overlaps tensor 'a' .bytes 0 to 64."),
    ([("a", (8,), F32_TYPE, 0), ("a", (8,), F32_TYPE, 32)], 64, "two tensors have this name"),
    ([("", (8,), F32_TYPE, 0)], 32, "printable and not empty"),
    ([("a\x00b", (8,), F32_TYPE, 0)], 32, "printable and not empty"),
    ([("n" * 64, (8,), F32_TYPE, 0)], 32, "a tensor name is 64 bytes long; at most 63"),
])
def test_a_broken_tensor_is_refused(tensors: list[tuple[str, tuple[int, ...], int, int]],
                                    data_bytes: int, match: str) -> None:
    refused(gguf_bytes([ARCH], tensors, data_bytes), match)


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_dimensions_are_one_to_four(n_dims: int) -> None:
    table = struct.pack("<Q", 1) + b"a" + struct.pack("<I", n_dims) + bytes(8 * 4 + 12)
    data = struct.pack("<IIQQ", 0x46554747, 3, 1, 1) + ARCH + table + bytes(64)
    refused(data, f"tensor 'a' has {n_dims} dimensions; ggml allows 1 to 4")


def test_alignment_is_the_files_own() -> None:
    align64 = kv("general.alignment", U32, 64)
    check(gguf_bytes([ARCH, align64], [("a", (8,), F32_TYPE, 0), ("b", (8,), F32_TYPE, 64)],
                     128, alignment=64))
    refused(gguf_bytes([ARCH, align64], [("a", (8,), F32_TYPE, 0), ("b", (8,), F32_TYPE, 32)],
                       128, alignment=64), "offset 32 is not aligned to 64")


# --- reading through a file, and prefixes ----------------------------------------------------


def test_a_prefix_asks_for_more_and_the_file_reader_reads_it() -> None:
    data = SMOLLM2.read_bytes()[:4 << 20]
    size = SMOLLM2.stat().st_size
    with pytest.raises(GgufTruncated) as caught:
        check_gguf_header(data[:100_000], "m", size)
    assert 100_000 < caught.value.needed <= 1_785_664
    whole = check_gguf_header(data, "m", size)
    with SMOLLM2.open("rb") as handle:
        stepwise = check_gguf_file(handle, "m", first_read_bytes=4096)
    assert stepwise.tensors == whole.tensors
    assert stepwise.data_start == whole.data_start == 1_785_664


def test_a_header_past_the_read_limit_is_refused() -> None:
    with SMOLLM2.open("rb") as handle, pytest.raises(GgufInvalid, match="at most 1,000,000"):
        check_gguf_file(handle, "m", limits=GgufLimits(max_header_bytes=1_000_000))


def test_a_file_that_ends_inside_its_header_is_refused() -> None:
    cut = SMOLLM2.read_bytes()[:500_000]
    with pytest.raises(GgufInvalid, match=r"header ends early|claims"):
        check_gguf_file(io.BytesIO(cut), "cut")


# --- split models ----------------------------------------------------------------------------


def _part(no: int, count: int, names: list[str], total: int | None = None) -> object:
    kvs = [kv("split.no", 2, no), kv("split.count", 2, count)]
    if total is not None:
        kvs.append(kv("split.tensors.count", I32, total))
    tensors = [(name, (8,), F32_TYPE, 32 * i) for i, name in enumerate(names)]
    return check(gguf_bytes([ARCH, *kvs], tensors, 32 * len(names)))


def test_split_parts_must_agree() -> None:
    first, second = _part(0, 2, ["a", "b"], 3), _part(1, 2, ["c"])
    check_split_parts({0: first, 1: second}, "m", 2)  # type: ignore[dict-item]
    check_split_parts({0: first}, "m", 2)  # type: ignore[dict-item]  # a part missing: no total
    with pytest.raises(GgufInvalid, match="part 2 of 2 says it is part 1 of 2"):
        check_split_parts({0: first, 1: _part(0, 2, ["c"])}, "m", 2)  # type: ignore[dict-item]
    with pytest.raises(GgufInvalid, match="tensor 'b' is in part 1 and in part 2"):
        check_split_parts({0: first, 1: _part(1, 2, ["b"])}, "m", 2)  # type: ignore[dict-item]
    with pytest.raises(GgufInvalid, match=r"split\.tensors\.count is 3, but the 2 parts hold 4"):
        check_split_parts({0: first, 1: _part(1, 2, ["c", "d"])}, "m", 2)  # type: ignore[dict-item]
    with pytest.raises(GgufInvalid, match="part 1 of 3 says it is part 1 of 2"):
        check_split_parts({0: first}, "m", 3)  # type: ignore[dict-item]


# --- the memo of walked vocabularies ---------------------------------------------------------


def test_the_memo_never_changes_an_answer() -> None:
    base = load_base()
    size = SMOLLM2.stat().st_size
    memo = StringArrayMemo()
    check_gguf_header(base.header, "m", size, memo=memo)
    assert memo.hits == 0
    check_gguf_header(base.header, "m", size, memo=memo)
    assert memo.hits == 2  # the tokens and the merges, compared instead of walked

    # A token's length inflated, same place, same count: the bytes differ, so it is walked.
    spot = next(f for f in base.string_lengths if f.what == "item of tokenizer.ggml.tokens")
    bent = bytearray(base.header)
    bent[spot.pos : spot.pos + 8] = struct.pack("<Q", 2**30)
    for with_memo in (None, memo):
        with pytest.raises(GgufInvalid, match="is 1,073,741,824 bytes long"):
            check_gguf_header(bytes(bent), "m", size, memo=with_memo)


def test_the_queens_lenient_reading_is_unchanged_for_header_only_files() -> None:
    from tests.support.fake_hub import gguf_header_only

    data = gguf_header_only(7_000_000_000, vocab=2000)
    header = parse_gguf_header(data, "m", 14 << 30)
    assert header.parameter_count == 7_000_000_000
    with pytest.raises(GgufInvalid):  # no tensor data: the checks refuse it as a model file
        check_gguf_header(data, "m", len(data))


def test_a_chat_template_rewrite_keeps_the_real_file_valid() -> None:
    base = load_base()
    header = with_string(base, "tokenizer.chat_template", "{{ messages[0].content }}")
    size = len(header) + base.data_bytes
    checked = check_gguf_header(header, "edited", size)
    assert checked.metadata["tokenizer.chat_template"] == "{{ messages[0].content }}"
    assert checked.data_start == len(header)
