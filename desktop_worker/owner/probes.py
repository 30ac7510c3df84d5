"""Reading the machine for the owner controls: the battery, other programs on the GPU, a
full-screen app. Every read is blocking (NVML, a subprocess): the watcher runs it in a thread.

``OwnerProbe`` is the interface: ``read(wants)`` returns ``OwnerReadings`` with None for
whatever it cannot tell. Implementations:

- ``NullProbe``: knows nothing, so never pauses (settings that need no reading).
- ``FixedProbe``: answers what it is given (tests, and anyone who feeds readings in).
- ``SystemProbe``: the real machine.
  - battery: ``psutil.sensors_battery()`` (Linux, Windows, macOS, FreeBSD); no battery reads as
    "not on battery".
  - GPU: NVML's lists of compute and graphics processes per NVIDIA GPU, less this process's
    pid, as a share of that GPU's memory; where NVML cannot say a process's memory (Windows
    WDDM, some containers) the GPU's utilisation, when this process is not on that GPU. AMD,
    Intel and Apple GPUs are unknown. In a container NVML names the host's pids, so this
    worker's own use would count as another program's: leave the GPU threshold off there.
  - full-screen: on X11 (``DISPLAY`` set, ``xprop`` installed) the active window's
    ``_NET_WM_STATE_FULLSCREEN``; on Windows ``SHQueryUserNotificationState`` (a full-screen
    or Direct3D app, or presentation mode; the app's name is unknown). Wayland without
    XWayland, macOS and anything else are unknown.

A failed read is unknown, logged once per probe (at WARNING), and never raised.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Protocol

import psutil

from desktop_worker.hardware.nvidia import NvmlApi, nvml_session
from desktop_worker.owner.policy import OwnerReadings, PauseSettings, Wants, wants_for

log = logging.getLogger(__name__)

XPROP_TIMEOUT_S = 2.0
_WINDOW_ID = re.compile(r"window id # (0x[0-9a-fA-F]+)")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
# SHQueryUserNotificationState: QUNS_BUSY (a full-screen app), QUNS_RUNNING_D3D_FULL_SCREEN,
# QUNS_PRESENTATION_MODE.
_WINDOWS_FULLSCREEN_STATES = {2, 3, 4}


class OwnerProbe(Protocol):
    def read(self, wants: Wants) -> OwnerReadings:
        """What the machine says now, for the readings ``wants`` names (blocking)."""
        ...


class NullProbe:
    """Knows nothing: never pauses."""

    def read(self, wants: Wants) -> OwnerReadings:
        return OwnerReadings()


class FixedProbe:
    """Answers ``readings`` (change it at will), or raises ``error`` when set; counts reads."""

    def __init__(self, readings: OwnerReadings | None = None) -> None:
        self.readings = readings or OwnerReadings()
        self.error: BaseException | None = None
        self.reads = 0

    def read(self, wants: Wants) -> OwnerReadings:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.readings


def default_probe(settings: PauseSettings) -> OwnerProbe:
    """The real probe when a setting needs a reading, else ``NullProbe`` (hours alone)."""
    return SystemProbe() if wants_for(settings).any else NullProbe()


class _Once:
    """Logs each kind of failure once per probe: a missing driver is said once, not every 5 s."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def __call__(self, key: str, message: str, *args: Any) -> None:
        level = logging.DEBUG if key in self.said else logging.WARNING
        self.said.add(key)
        log.log(level, message, *args)


class SystemProbe:
    """The real machine. ``nvml``: the NVML module (None: the real ``pynvml``); ``run``: how
    a command is run (``subprocess.run``); ``platform``: ``sys.platform``; ``pid``: this
    process. The parameters are for tests; the app uses the defaults."""

    def __init__(
        self,
        *,
        nvml: NvmlApi | None = None,
        battery: Callable[[], Any] | None = None,
        run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        platform: str = sys.platform,
        pid: int | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        self._nvml = nvml
        self._battery = battery
        self._run = run
        self._platform = platform
        self._pid = os.getpid() if pid is None else pid
        self._environ = os.environ if environ is None else environ
        self._once = _Once()

    def read(self, wants: Wants) -> OwnerReadings:
        on_battery = self._guard("battery", self.on_battery) if wants.battery else None
        gpu = self._guard("gpu", self.gpu_others) if wants.gpu else None
        full = self._guard("fullscreen", self.fullscreen) if wants.fullscreen else None
        pct, measure = gpu if gpu is not None else (None, "memory")
        fullscreen, app = full if full is not None else (None, None)
        return OwnerReadings(on_battery=on_battery, gpu_others_pct=pct, gpu_measure=measure,
                             fullscreen=fullscreen, fullscreen_app=app)

    def _guard(self, what: str, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Exception as exc:  # any probe failure is "unknown", never a crash
            self._once(f"{what}:{type(exc).__name__}", "cannot read the %s for the owner's "
                       "pause settings (treated as unknown): %s", what, exc)
            return None

    # --- battery ----------------------------------------------------------------------------

    def on_battery(self) -> bool | None:
        read = self._battery or getattr(psutil, "sensors_battery", None)
        if read is None:
            self._once("battery:unsupported", "this system cannot tell whether it runs on "
                       "battery; 'pause on battery' does nothing here")
            return None
        battery = read()
        if battery is None:
            return False  # no battery: a desktop, always on mains power
        plugged = getattr(battery, "power_plugged", None)
        return None if plugged is None else not plugged

    # --- the GPU ----------------------------------------------------------------------------

    def gpu_others(self) -> tuple[int | None, str]:
        """(the largest share any GPU gives other processes, "memory" or "time")."""
        with nvml_session(self._nvml) as (nvml, reason):
            if nvml is None:
                self._once("gpu:nvml", "no GPU process list (%s): the GPU threshold does "
                           "nothing here", reason)
                return None, "memory"
            best: tuple[int | None, str] = (None, "memory")
            for index in range(nvml.nvmlDeviceGetCount()):
                share = self._device_share(nvml, index)
                if share[0] is not None and (best[0] is None or share[0] > best[0]):
                    best = share
            return best

    def _device_share(self, nvml: Any, index: int) -> tuple[int | None, str]:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        processes = []
        for listing in ("nvmlDeviceGetComputeRunningProcesses",
                        "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                processes.extend(getattr(nvml, listing)(handle))
            except nvml.NVMLError as exc:
                self._once(f"gpu:{listing}", "NVML cannot list GPU %d's processes: %s",
                           index, exc)
        seen: dict[int, int | None] = {}
        for process in processes:  # a process on both lists is counted once
            used = getattr(process, "usedGpuMemory", None)
            seen[int(process.pid)] = used if isinstance(used, int) else seen.get(process.pid)
        mine = self._pid in seen
        others = {pid: used for pid, used in seen.items() if pid != self._pid}
        if not others:
            return 0, "memory"
        if all(used is not None for used in others.values()) and total > 0:
            used_bytes = sum(u for u in others.values() if u is not None)
            return min(100, round(used_bytes * 100 / total)), "memory"
        if mine:  # the GPU's time is partly ours: cannot tell the others' share
            return None, "memory"
        rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        return min(100, max(0, int(rates.gpu))), "time"

    # --- full-screen apps -------------------------------------------------------------------

    def fullscreen(self) -> tuple[bool | None, str | None]:
        if self._platform.startswith("win"):
            return self._windows_fullscreen(), None
        if self._environ.get("DISPLAY") and shutil.which("xprop"):
            return self._x11_fullscreen()
        self._once("fullscreen:unsupported", "cannot tell whether a full-screen app runs on "
                   "this desktop (supported: X11 with xprop, and Windows); 'pause for "
                   "full-screen apps' does nothing here")
        return None, None

    def _xprop(self, *args: str) -> str:
        done = self._run(["xprop", *args], capture_output=True, text=True,
                         timeout=XPROP_TIMEOUT_S, check=True)
        return done.stdout

    def _x11_fullscreen(self) -> tuple[bool | None, str | None]:
        match = _WINDOW_ID.search(self._xprop("-root", "_NET_ACTIVE_WINDOW"))
        if match is None or int(match.group(1), 16) == 0:
            return False, None  # no active window
        window = match.group(1)
        text = self._xprop("-id", window, "_NET_WM_STATE", "WM_CLASS", "_NET_WM_NAME")
        return parse_x11_window(text)

    def _windows_fullscreen(self) -> bool | None:
        import ctypes  # Windows only: shell32

        state = ctypes.c_int(0)
        windll = getattr(ctypes, "windll", None)
        if windll is None:
            return None
        result = windll.shell32.SHQueryUserNotificationState(ctypes.byref(state))
        if result != 0:
            raise OSError(f"SHQueryUserNotificationState failed ({result:#x})")
        return state.value in _WINDOWS_FULLSCREEN_STATES


def parse_x11_window(text: str) -> tuple[bool, str | None]:
    """(full-screen?, the app's name) from ``xprop -id W _NET_WM_STATE WM_CLASS _NET_WM_NAME``.
    The name is WM_CLASS's class (e.g. "Firefox"), else the window's title."""
    fullscreen = False
    name: str | None = None
    title: str | None = None
    for line in text.splitlines():
        if line.startswith("_NET_WM_STATE("):
            fullscreen = "_NET_WM_STATE_FULLSCREEN" in line
        elif line.startswith("WM_CLASS("):
            parts = _QUOTED.findall(line)
            name = parts[-1] if parts else None
        elif line.startswith("_NET_WM_NAME("):
            parts = _QUOTED.findall(line)
            title = parts[0] if parts else None
    shown = (name or title or "").strip() or None
    return fullscreen, shown
