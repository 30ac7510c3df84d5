"""llama.cpp's RPC backend through ctypes, in an engine child only (issue 34): the worker's own
process never loads llama.cpp. ``LlamaRpc`` probes the build, lists the devices, serves them
(a member's child: ``serve_member``) and adds a member's server as devices (a head's child).
``groups/rpc.py`` explains how every function is found through libllama's own handle.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

from desktop_worker.errors import GroupError
from desktop_worker.groups.rpc import RPC_PROTOCOL, Device, DeviceType, RpcProbe, group_devices

log = logging.getLogger(__name__)


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


def serve_member(endpoint: str, n_threads: int, count: int | None = None,
                 gpus: bool = True) -> None:
    """In a member's engine child: serve this machine's devices (its first ``count``; None:
    all) on ``endpoint`` until killed. ``gpus``: the worker's GPUs may take layers
    (``group_devices``; False when its owner keeps them off the GPU: its CPU is served)."""
    rpc = LlamaRpc()
    devices = rpc.served_devices(gpus)[:count]
    for device in devices:
        log.info("serving %s (%s, %d MiB free) on %s", device.name, device.description,
                 device.free_bytes // (1024 * 1024), endpoint)
    rpc.serve(endpoint, devices, n_threads)
    raise SystemExit(f"llama.cpp's RPC server could not start on {endpoint}")
