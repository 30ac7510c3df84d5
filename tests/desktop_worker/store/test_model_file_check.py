"""A model file is checked before llama.cpp may open it: where files enter the worker (a
download, an import, a ``--model`` path: all through ``read_gguf_info``) and right before a
load (``check_model_file``, every part of a split model). A hostile file is refused in plain
words and nothing of it is kept."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from desktop_worker.errors import InvalidModelFile
from desktop_worker.store import ModelStore
from desktop_worker.store.gguf_info import check_model_file, read_gguf_info
from tests.support.fake_hub import FakeHub, FakeRepo, make_split_gguf
from tests.support.gguf_mutants import (
    SMOLLM2,
    accepted_mutant_files,
    gguf_bytes,
    kv,
    load_base,
    model_with_chat_template,
)

ARCH = kv("general.architecture", 8, "llama")
# A tensor whose data would lie far past the end of the file (llama.cpp would map it).
OUT_OF_FILE = gguf_bytes([ARCH], [("blk.0.attn_q.weight", (8, 8), 0, 1 << 40)], 256)


def test_the_real_model_passes() -> None:
    check_model_file(SMOLLM2)


def test_a_hostile_file_is_refused_in_plain_words(tmp_path: Path) -> None:
    path = tmp_path / "evil.gguf"
    path.write_bytes(OUT_OF_FILE)
    with pytest.raises(InvalidModelFile, match=r"evil\.gguf: tensor 'blk\.0\.attn_q\.weight': "
                                               r"the file is truncated or the offset is wrong"):
        check_model_file(path)
    with pytest.raises(InvalidModelFile, match=re.escape("blk.0.attn_q.weight")):
        read_gguf_info(path)


def test_a_file_with_an_oversized_chat_template_is_refused(tmp_path: Path) -> None:
    path = model_with_chat_template(tmp_path / "big-template.gguf", "{{ 'x' }}" * 20_000)
    with pytest.raises(InvalidModelFile, match=re.escape(
            "chat template 'tokenizer.chat_template' is 180,000 bytes; at most 131,072")):
        check_model_file(path)


def test_an_import_refuses_a_hostile_file_and_keeps_nothing(tmp_path: Path) -> None:
    source = tmp_path / "evil.gguf"
    source.write_bytes(OUT_OF_FILE)
    store = ModelStore(tmp_path / "models")
    with pytest.raises(InvalidModelFile, match="offset is wrong"):
        store.import_file(source, "evil")
    assert store.list() == []
    assert not any((tmp_path / "models").rglob("*.gguf"))


def test_a_download_refuses_a_hostile_file_and_deletes_it(tmp_path: Path) -> None:
    repo = FakeRepo("evil/Model-GGUF", files={"model-Q8_0.gguf": OUT_OF_FILE})
    with FakeHub([repo]) as hub:
        store = ModelStore(tmp_path / "models", endpoint=hub.url)
        with pytest.raises(InvalidModelFile, match="offset is wrong"):
            store.pull("evil/Model-GGUF:Q8_0")
    assert store.list() == []
    assert not any((tmp_path / "models").rglob("*.gguf"))


# --- split models ----------------------------------------------------------------------------


def test_every_part_of_a_split_model_is_checked_before_a_load(tmp_path: Path) -> None:
    parts = make_split_gguf(tmp_path, "m-Q8_0", 3)
    check_model_file(parts[0])
    assert read_gguf_info(parts[0]).parts == 3

    parts[1].unlink()
    missing = re.escape("part m-Q8_0-00002-of-00003.gguf is missing")
    with pytest.raises(InvalidModelFile, match=missing):
        check_model_file(parts[0])
    assert read_gguf_info(parts[0]).parts == 2  # the facts of what is there, as before


def test_parts_that_disagree_are_refused(tmp_path: Path) -> None:
    parts = make_split_gguf(tmp_path, "m", 2)
    shutil.copyfile(parts[0], parts[1])  # part 2 is a copy of part 1: split.no 0, same tensors
    with pytest.raises(InvalidModelFile, match="part 2 of 2 says it is part 1 of 2"):
        check_model_file(parts[0])
    with pytest.raises(InvalidModelFile, match="part 2 of 2 says it is part 1 of 2"):
        read_gguf_info(parts[0])


def test_a_first_part_must_be_named_as_one(tmp_path: Path) -> None:
    parts = make_split_gguf(tmp_path, "m", 2)
    renamed = parts[0].rename(tmp_path / "model.gguf")
    named = re.escape("must be named <name>-00001-of-00002.gguf")
    with pytest.raises(InvalidModelFile, match=named):
        check_model_file(renamed)


# --- what the mutant corpus lets through --------------------------------------------------------


def test_accepted_mutants_come_as_files_that_pass_and_are_removed(tmp_path: Path) -> None:
    base = load_base()
    seen = []
    for path in accepted_mutant_files(tmp_path, count=2, base=base):
        assert path.stat().st_size > 90_000_000
        check_model_file(path)  # what the engine child will call before it loads
        seen.append(path)
    assert len(seen) == 2
    assert not any(p.exists() for p in seen)
