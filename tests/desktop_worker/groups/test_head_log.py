"""What the head reads from llama.cpp's log while it loads (pure): each device's model buffer,
and which RPC server could not allocate its share (both of llama.cpp's wordings: the weights'
buffer and ggml-alloc's compute buffers)."""

from __future__ import annotations

import pytest

from desktop_worker.groups.head_load import _LoadLog


@pytest.mark.parametrize("line", [
    "llama_model_load: error loading model: unable to allocate RPC0[127.0.0.1:40283] buffer\n",
    "ggml_gallocr_reserve_n: failed to allocate RPC1[127.0.0.1:40283] buffer of size 123456\n",
])
def test_a_server_that_could_not_allocate_is_named(line: str) -> None:
    log = _LoadLog()
    log(4, b"load_tensors:   RPC0[127.0.0.1:1] model buffer size =    21.10 MiB\n", None)
    half = len(line) // 2  # llama.cpp may log a line in pieces
    log(4, line[:half].encode(), None)
    log(4, line[half:].encode(), None)
    assert log.short == "127.0.0.1:40283"
    assert log.buffers == {"RPC0[127.0.0.1:1]": int(21.10 * 1024 * 1024)}


def test_other_failures_name_no_server() -> None:
    log = _LoadLog()
    log(4, b"llama_model_load: error loading model: unable to allocate CPU buffer\n", None)
    log(4, b"failed to allocate compute buffers\n", None)
    assert log.short is None
