"""llama.cpp's RPC backend (issue 19: one model over several workers): what the worker knows of
it without loading llama.cpp (the devices' rule, the probe's answer, the seam), and the notes
on how ``rpc_backend.LlamaRpc`` reaches it through ctypes, in an engine child only (issue 34).

llama-cpp-python no longer passes RPC servers to llama.cpp, but a build with
``CMAKE_ARGS=-DGGML_RPC=on`` links ``libggml-rpc`` into ``libggml``, whose C functions do
everything a group needs: ``ggml_backend_rpc_start_server`` serves this machine's devices (a
member), ``ggml_backend_rpc_add_server`` makes a remote server's devices local ones (a head).
The signatures are those of the llama.cpp that llama-cpp-python 0.3.36 vendors
(``ggml/include/ggml-rpc.h``, RPC protocol 7.0.0).

Every symbol is looked up **in the library llama_cpp already loaded**. The wheel ships its
shared libraries as copies, not symlinks (``libggml.so``, ``libggml.so.0``, ...), so opening one
by path on Linux would load a second ggml with its own device registry, and a server registered
there is invisible to the model loader. ``dlsym`` on libllama's handle searches its
dependencies, so the functions found there are the loader's own. Windows does not search
dependencies; there each DLL is opened by the full path llama_cpp loaded it from, which Windows
maps to the module already loaded.

``RpcSupport`` is the platform seam: ``rpc_probe.SandboxedRpc`` is the worker's (it asks an
engine child, where ``rpc_backend.LlamaRpc`` is the real one), ``NullRpc`` the answer for a
build without RPC (and for tests of everything above it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

log = logging.getLogger(__name__)

# ggml-rpc.h's RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION in the llama.cpp that 0.3.36 vendors
RPC_PROTOCOL = "7.0.0"
MIB = 1024 * 1024


def quiet_aborts() -> None:
    """In a head's or member's child process: when llama.cpp aborts it (any RPC failure does,
    by design), print its one-line reason but no backtrace. ggml's ``ggml_print_backtrace``
    otherwise attaches gdb, if installed, which takes seconds and fills the owner's log with
    a stack dump for an expected event (a member leaving). ``GGML_NO_BACKTRACE`` is read at
    abort time; a value already in the environment is kept (to debug with it on)."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")


class DeviceType(IntEnum):
    """``enum ggml_backend_dev_type``."""

    CPU = 0
    GPU = 1
    IGPU = 2
    ACCEL = 3
    META = 4


@dataclass(frozen=True, slots=True)
class Device:
    """One ggml device as the registry lists it."""

    handle: int
    name: str
    description: str
    type: DeviceType
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class RpcProbe:
    """Whether this worker can join a group, and its llama.cpp build: only identical builds
    are grouped (the RPC protocol has no versioning across them)."""

    available: bool
    build: str | None = None
    reason: str = ""


def group_devices(devices: Sequence[Device], *, gpus: bool) -> list[Device]:
    """The devices a worker gives a model group, out of llama.cpp's ``devices``: its GPUs
    (GPU and integrated GPU devices) when it has any and its owner lets layers on them
    (``gpus``: ``gpu_layers`` is not 0), else its CPU. Never an RPC device (a server this
    process added), so a member can never chain to another server. One rule for what a
    member's server serves, what a head offloads its own layers to and what the queen is told
    (``device_free_mb``): the queen's plan has one entry per device listed here."""
    local = [d for d in devices if not d.name.startswith("RPC")]
    found = [d for d in local if d.type in (DeviceType.GPU, DeviceType.IGPU)] if gpus else []
    return found or [d for d in local if d.type == DeviceType.CPU][:1]


def device_free_mb(devices: Sequence[Device], budget_mb: int, *, gpus: bool,
                   vram_cap_mb: int | None = None) -> list[int]:
    """The memory, MB, of each device ``group_devices`` gives a group, as the queen plans with
    it: a GPU's free memory as llama.cpp reports it (MiB, rounded down), within the owner's
    ``vram_cap_mb`` (the most GPU memory the worker may use, shared out over the GPUs in
    llama.cpp's order); the CPU's is the pool's ``budget_mb`` (RAM the owner lets models use,
    not all the machine has). Empty when llama.cpp lists no usable device."""
    left = vram_cap_mb
    found: list[int] = []
    for device in group_devices(devices, gpus=gpus):
        if device.type == DeviceType.CPU:
            found.append(max(0, budget_mb))
            continue
        free = max(0, device.free_bytes) // MIB
        if left is not None:
            free = min(free, left)
            left -= free
        found.append(free)
    return found


class RpcSupport(Protocol):
    def probe(self) -> RpcProbe: ...

    def devices(self) -> list[Device]:
        """llama.cpp's devices, in its order (blocking: it may load llama.cpp and asks the GPU
        driver); ``GroupError`` when they cannot be listed."""
        ...


class NullRpc:
    """No RPC backend: the worker never joins a group."""

    def __init__(self, reason: str = "llama.cpp was built without its RPC backend") -> None:
        self.reason = reason

    def probe(self) -> RpcProbe:
        return RpcProbe(False, None, self.reason)

    def devices(self) -> list[Device]:
        return []  # nothing a group could use
