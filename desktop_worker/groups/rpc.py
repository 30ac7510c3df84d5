"""llama.cpp's RPC backend, reached through ctypes (issue 19: one model over several workers).

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

``RpcSupport`` is the platform seam: ``LlamaRpc`` is the real one, ``NullRpc`` the answer for a
build without RPC (and for tests of everything above it).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

from desktop_worker.errors import GroupError

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


def device_free_mb(devices: Sequence[Device], budget_mb: int, *, gpus: bool) -> list[int]:
    """The memory, MB, of each device ``group_devices`` gives a group, as the queen plans with
    it: a GPU's free memory as llama.cpp reports it (MiB, rounded down); the CPU's is the
    pool's ``budget_mb`` (RAM the owner lets models use, not all the machine has). Empty when
    llama.cpp lists no usable device."""
    return [max(0, budget_mb) if d.type == DeviceType.CPU else max(0, d.free_bytes) // MIB
            for d in group_devices(devices, gpus=gpus)]


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


def _bind(lib: Any, name: str, restype: Any, argtypes: list[Any]) -> Any:
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = argtypes
    return function


class LlamaRpc:
    """The RPC backend of the llama.cpp that ``llama_cpp`` loaded."""

    def __init__(self) -> None:
        self._functions: dict[str, Any] | None = None
        self._error = ""

    # -- the library -------------------------------------------------------------------------

    def _libraries(self) -> list[Any]:
        import llama_cpp.llama_cpp as bindings  # loads libllama and its ggml

        if os.name != "nt":
            return [bindings._lib]
        lib_dir = Path(bindings.__file__).parent / "lib"
        return [ctypes.CDLL(str(lib_dir / name))
                for name in ("ggml-base.dll", "ggml.dll") if (lib_dir / name).exists()]

    def _load(self) -> dict[str, Any]:
        if self._functions is not None:
            return self._functions
        vp, cp, size = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        table = {
            "ggml_version": (cp, []),
            "ggml_commit": (cp, []),
            "ggml_backend_reg_by_name": (vp, [cp]),
            "ggml_backend_reg_get_proc_address": (vp, [vp, cp]),
            "ggml_backend_register": (None, [vp]),
            "ggml_backend_reg_dev_count": (size, [vp]),
            "ggml_backend_reg_dev_get": (vp, [vp, size]),
            "ggml_backend_dev_count": (size, []),
            "ggml_backend_dev_get": (vp, [size]),
            "ggml_backend_dev_name": (cp, [vp]),
            "ggml_backend_dev_description": (cp, [vp]),
            "ggml_backend_dev_type": (ctypes.c_int, [vp]),
            "ggml_backend_dev_memory": (None, [vp, ctypes.POINTER(size), ctypes.POINTER(size)]),
            "ggml_backend_dev_buffer_type": (vp, [vp]),
        }
        functions: dict[str, Any] = {}
        try:
            libraries = self._libraries()
            for name, (restype, argtypes) in table.items():
                for lib in libraries:
                    if hasattr(lib, name):
                        functions[name] = _bind(lib, name, restype, argtypes)
                        break
                else:
                    raise AttributeError(name)
        except (ImportError, OSError, AttributeError) as exc:
            raise GroupError(f"llama.cpp's ggml functions are not reachable: {exc}") from exc
        reg = functions["ggml_backend_reg_by_name"](b"RPC")
        if not reg:
            raise GroupError("llama.cpp was built without its RPC backend "
                             "(CMAKE_ARGS=-DGGML_RPC=on; see installers/build_llama.sh)")
        address = functions["ggml_backend_reg_get_proc_address"]
        start = address(reg, b"ggml_backend_rpc_start_server")
        add = address(reg, b"ggml_backend_rpc_add_server")
        if not start or not add:
            raise GroupError("llama.cpp's RPC backend lacks start_server/add_server")
        functions["start_server"] = ctypes.CFUNCTYPE(
            None, cp, cp, size, size, ctypes.POINTER(vp))(start)
        functions["add_server"] = ctypes.CFUNCTYPE(vp, cp)(add)
        self._functions = functions
        return functions

    # -- what a worker asks ------------------------------------------------------------------

    def probe(self) -> RpcProbe:
        try:
            functions = self._load()
        except GroupError as exc:
            return RpcProbe(False, None, str(exc))
        return RpcProbe(True, self.build(functions))

    @staticmethod
    def build(functions: dict[str, Any]) -> str:
        """ggml's version and commit, and the RPC protocol: what must match across a group."""
        version = functions["ggml_version"]().decode()
        commit = functions["ggml_commit"]().decode()
        return f"ggml-{version}+{commit}/rpc-{RPC_PROTOCOL}"

    def devices(self) -> list[Device]:
        functions = self._load()
        return [self._device(functions["ggml_backend_dev_get"](i))
                for i in range(functions["ggml_backend_dev_count"]())]

    def _device(self, handle: int) -> Device:
        functions = self._load()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        functions["ggml_backend_dev_memory"](handle, ctypes.byref(free), ctypes.byref(total))
        return Device(
            handle=handle,
            name=functions["ggml_backend_dev_name"](handle).decode(errors="replace"),
            description=functions["ggml_backend_dev_description"](handle).decode(
                errors="replace"),
            type=DeviceType(functions["ggml_backend_dev_type"](handle)),
            free_bytes=free.value,
            total_bytes=total.value,
        )

    def served_devices(self, gpus: bool = True) -> list[Device]:
        """What a member serves: ``group_devices`` (its GPUs when it has any and ``gpus``,
        else its CPU)."""
        return group_devices(self.devices(), gpus=gpus)

    def cpu_buffer_type(self) -> int:
        """The CPU device's buffer type (host memory), for llama.cpp's tensor overrides."""
        functions = self._load()
        for device in self.devices():
            if device.type == DeviceType.CPU:
                buft = functions["ggml_backend_dev_buffer_type"](device.handle)
                if buft:
                    return int(buft)
        raise GroupError("llama.cpp lists no CPU device")

    # -- member and head ---------------------------------------------------------------------

    def serve(self, endpoint: str, devices: list[Device], n_threads: int) -> None:
        """Serve ``devices`` on ``endpoint`` (``127.0.0.1:port``) until the process ends. This
        returns only when the server could not start (llama.cpp prints why on stderr)."""
        if not devices:
            raise GroupError("no device to serve")
        functions = self._load()
        handles = (ctypes.c_void_p * len(devices))(*(d.handle for d in devices))
        functions["start_server"](endpoint.encode(), None, max(1, n_threads), len(devices),
                                  handles)

    def add_server(self, endpoint: str) -> list[Device]:
        """Register a (proxied) RPC server's devices with the model loader, after those added
        before; returns them. llama.cpp puts RPC devices first, in this order, then the local
        GPUs."""
        functions = self._load()
        reg = functions["add_server"](endpoint.encode())
        if not reg:
            raise GroupError(f"llama.cpp could not add the RPC server {endpoint}")
        count = functions["ggml_backend_reg_dev_count"](reg)
        if count == 0:
            raise GroupError(f"the RPC server {endpoint} has no devices")
        added = [functions["ggml_backend_reg_dev_get"](reg, i) for i in range(count)]
        functions["ggml_backend_register"](reg)  # as llama.cpp's own --rpc does
        return [self._device(handle) for handle in added]
