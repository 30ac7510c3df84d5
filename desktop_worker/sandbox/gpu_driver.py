"""Starting a GPU driver inside an engine child, between the two steps of its confinement.

The NVIDIA driver's ``cuInit`` makes, binds and listens on a Unix socket and writes its threads'
names; once it has started, a context, device memory and pinned host memory need none of that
(issue 41, an H200 with driver 580: ``bench/gpu_sandbox_probe.py``). So ``confine`` lets the
driver start under the first step's filter and then stacks the lock (``seccomp.driver_lock``).
Chromium's GPU process does the same: it warms its driver up before the sandbox closes.

A machine without the NVIDIA driver library has nothing to start here; the runtimes llama.cpp
loads later (Vulkan, ROCm) start under the locked sandbox.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

NVIDIA_DRIVER_LIBRARIES = ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1",
                           "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                           "/usr/lib/aarch64-linux-gnu/libcuda.so.1")


@dataclass(frozen=True, slots=True)
class DriverStart:
    """What starting the driver did: which library (None: none found) and ``cuInit``'s
    result (0 is success; 100 is "no device")."""

    library: str | None
    result: int | None = None

    @property
    def started(self) -> bool:
        return self.result == 0

    def describe(self) -> str:
        if self.library is None:
            return "no NVIDIA driver library: nothing to start before the sandbox closes"
        if self.started:
            return f"the NVIDIA driver started ({self.library})"
        return f"the NVIDIA driver did not start: cuInit returned {self.result}"


class GpuDriver:
    """Starts the NVIDIA driver in this process. One job, testable with another library list."""

    def __init__(self, libraries: tuple[str, ...] = NVIDIA_DRIVER_LIBRARIES) -> None:
        self.libraries = libraries
        self._handle: ctypes.CDLL | None = None  # kept: the driver stays loaded

    def start(self) -> DriverStart:
        for name in self.libraries:
            try:
                handle = ctypes.CDLL(name)
            except OSError:
                continue
            init = getattr(handle, "cuInit", None)
            if init is None:
                continue
            self._handle = handle
            result = int(init(0))
            start = DriverStart(name, result)
            log.info("%s", start.describe())
            return start
        return DriverStart(None)
