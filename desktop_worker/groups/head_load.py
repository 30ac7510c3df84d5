"""A group head's load, in its engine child (issue 34: never in the worker's process): the
members' RPC servers added as devices, the model loaded with the queen's layer counts per
device (``layout``), and llama.cpp's own log read for what went where (``HeadReport``) and for
a member that could not allocate its share (``MemberShort``).
"""

from __future__ import annotations

import ctypes
import logging
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from desktop_worker.errors import MemberShort
from desktop_worker.groups.head import HeadConfig, HeadReport
from desktop_worker.groups.layout import load_layout

log = logging.getLogger(__name__)


_BUFFER = re.compile(r"load_tensors:\s+(\S.*?) model buffer size =\s+([\d.]+) MiB")
# llama.cpp's "unable to allocate RPC0[127.0.0.1:port] buffer" (weights) and ggml-alloc's
# "failed to allocate RPC0[...] buffer of size N" (compute buffers): a member that was given
# more than it could hold.
_SHORT = re.compile(r"(?:unable|failed) to allocate RPC\d*\[([^\]\s]+)\] buffer")


class _LoadLog:
    """llama.cpp's log, read while the head loads: the model buffer per device."""

    def __init__(self) -> None:
        self.buffers: dict[str, int] = {}
        self.short: str | None = None  # the endpoint of a server that could not allocate
        self._partial = ""

    def __call__(self, level: int, text: bytes, _user: Any) -> None:
        line = self._partial + text.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            self._partial = line
            return
        self._partial = ""
        match = _BUFFER.search(line)
        if match:
            self.buffers[match.group(1)] = int(float(match.group(2)) * 1024 * 1024)
        short = _SHORT.search(line)
        if short and self.short is None:
            self.short = short.group(1)
        if level in (3, 4):  # GGML_LOG_LEVEL_WARN, _ERROR (ggml.h of the vendored build)
            log.warning("llama.cpp: %s", line.strip())


def load_head(config: HeadConfig) -> tuple[Any, HeadReport, Any]:
    """In the head's engine child: the loaded context, what went where, and the log callback
    (which must outlive every call llama.cpp makes to it)."""
    import llama_cpp

    from desktop_worker.engine.llama_model import LlamaContext
    from desktop_worker.groups.rpc_backend import LlamaRpc
    from shared_schema.fitting import LoadPlan

    layout = load_layout(config.n_layer, config.cpu_layers, config.device_layers,
                         output_on_cpu=config.output_on_cpu)
    rpc = LlamaRpc()
    names: list[str] = []
    for endpoint in config.endpoints:
        names += [device.name for device in rpc.add_server(endpoint)]
    loader_log = _LoadLog()
    callback = llama_cpp.llama_log_callback(loader_log)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    started = time.monotonic()
    plan = LoadPlan(n_ctx=config.n_ctx, n_gpu_layers=layout.n_gpu_layers,
                    offloaded_layers=sum(config.device_layers), vram_needed_mb=0,
                    reason="a group's head: layers per device from the queen's plan")
    buft = rpc.cpu_buffer_type() if layout.cpu_tensors else 0
    with tensor_overrides(layout.cpu_tensors, buft) as overrides:
        try:
            context = LlamaContext(config.name, Path(config.model_path), plan,
                                   n_threads=config.n_threads, tensor_split=layout.tensor_split)
        except Exception as exc:
            if loader_log.short is None:
                raise
            raise MemberShort(loader_log.short, f"the RPC server at {loader_log.short} could "
                              f"not allocate the layers it was given: {exc}") from exc
    report = HeadReport(buffers=dict(loader_log.buffers), device_ranges=layout.device_ranges,
                        devices=tuple(names), load_s=time.monotonic() - started)
    for buffer, size in report.buffers.items():
        log.info("group %s: %s holds %.1f MiB of weights", config.name, buffer,
                 size / (1024 * 1024))
    return context, report, (callback, overrides)


class _Override(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h of the vendored build)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@contextmanager
def tensor_overrides(patterns: Sequence[str], buft: int) -> Iterator[Any]:
    """While a model loads, put the tensors whose names match ``patterns`` in the buffer type
    ``buft`` (llama.cpp's ``tensor_buft_overrides``); yields what must stay alive as long as
    the model does.

    llama-cpp-python's ``Llama`` has no argument for it (its ``llama_model_params`` declares
    the field, "unused"), so for the load, ``llama_model_default_params`` (which ``Llama``
    calls first) is wrapped to fill it in. Only in a head's own process, one load at a time."""
    if not patterns:
        yield None
        return
    import llama_cpp.llama_cpp as bindings

    table = (_Override * (len(patterns) + 1))()  # NULL-terminated
    for entry, pattern in zip(table, patterns, strict=False):
        entry.pattern = pattern.encode()
        entry.buft = buft
    original = bindings.llama_model_default_params

    def with_overrides() -> Any:
        params = original()
        params.tensor_buft_overrides = ctypes.cast(table, ctypes.c_void_p).value
        return params

    bindings.llama_model_default_params = with_overrides
    try:
        yield table
    finally:
        bindings.llama_model_default_params = original
