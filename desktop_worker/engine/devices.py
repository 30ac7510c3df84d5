"""Which GPUs llama.cpp really found in this process: ggml's backend devices.

The worker plans a load from NVML's reading, but the engine child is the one that starts the
GPU driver (CUDA, Vulkan...), and that can fail where NVML worked: a driver the sandbox does
not let start, a build without the backend. llama.cpp then loads every layer on the CPU with
no error. ``gpu_device_names`` asks ggml which devices it registered, so the child can tell the
worker (``Loaded.gpu_devices``) and the worker can say so.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# enum ggml_backend_dev_type (ggml-backend.h): CPU, GPU, IGPU, ACCEL, META
GPU_TYPES = frozenset({1, 2})
MAX_DEVICES = 16


def gpu_device_names() -> list[str] | None:
    """The names of ggml's GPU devices (``CUDA0``...), or None where this llama.cpp build
    does not say (its library lacks ggml's device API)."""
    try:
        from llama_cpp import llama_cpp as bindings

        lib = bindings._lib
        count = lib.ggml_backend_dev_count
        get = lib.ggml_backend_dev_get
        kind = lib.ggml_backend_dev_type
        name = lib.ggml_backend_dev_name
    except (ImportError, AttributeError) as exc:
        log.debug("ggml's device list is not available: %s", exc)
        return None
    count.restype, count.argtypes = ctypes.c_size_t, []
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    names = []
    for index in range(min(int(count()), MAX_DEVICES)):
        device = get(index)
        if device and kind(device) in GPU_TYPES:
            names.append((name(device) or b"?").decode(errors="replace")[:128])
    return names
