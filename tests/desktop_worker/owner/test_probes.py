"""The real probe's parsing, fed recorded answers: NVML's process lists (other programs' share
of a GPU, this process left out), the battery, xprop's windows; and failures read as unknown,
logged once, never raised."""

from __future__ import annotations

import logging
import subprocess
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from desktop_worker.owner import NullProbe, SystemProbe, Wants, default_probe
from desktop_worker.owner.probes import parse_x11_window
from desktop_worker.settings import WorkerSettings

GIB = 1024**3
ME = 4242
ALL = Wants(battery=True, gpu=True, fullscreen=True)


class ProcessNvml:
    """NVML with process lists: ``gpus`` is a list of (total bytes, compute, graphics,
    utilisation %), each process a (pid, used bytes or None)."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[tuple[int, list, list, int]], *, init_error: int | None = None,
                 list_error: bool = False) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.list_error = list_error
        self.started = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.started += 1

    def nvmlShutdown(self) -> None:
        self.started -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(total=self.gpus[handle][0])

    def _procs(self, items: list) -> list[Any]:
        if self.list_error:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in items]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return self._procs(self.gpus[handle][1])

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        return self._procs(self.gpus[handle][2])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self.gpus[handle][3])


def probe(nvml: Any = None, **kwargs: Any) -> SystemProbe:
    kwargs.setdefault("battery", lambda: None)
    kwargs.setdefault("environ", {})
    return SystemProbe(nvml=nvml, pid=ME, **kwargs)


@pytest.mark.parametrize(("gpus", "share"), [
    # Other programs' memory as a share of the GPU's; this worker's own use left out.
    ([(10 * GIB, [(ME, 6 * GIB), (7, 2 * GIB)], [(8, GIB)], 99)], (30, "memory")),
    # A process on both lists counts once.
    ([(10 * GIB, [(7, 5 * GIB)], [(7, 5 * GIB)], 0)], (50, "memory")),
    # Only this worker: nobody else.
    ([(10 * GIB, [(ME, 9 * GIB)], [], 100)], (0, "memory")),
    # The busiest of several GPUs.
    ([(8 * GIB, [(7, GIB)], [], 0), (8 * GIB, [], [(9, 6 * GIB)], 0)], (75, "memory")),
    # Memory unknown (WDDM) and this worker not on the GPU: the GPU's time.
    ([(8 * GIB, [], [(9, None)], 64)], (64, "time")),
    # Memory unknown and this worker on the GPU too: cannot tell.
    ([(8 * GIB, [(ME, None)], [(9, None)], 64)], (None, "memory")),
    ([], (None, "memory")),  # a driver with no GPU
])
def test_other_programs_share_of_the_gpu(gpus: list, share: tuple) -> None:
    nvml = ProcessNvml(gpus)
    got = probe(nvml).read(Wants(gpu=True))
    assert (got.gpu_others_pct, got.gpu_measure) == share
    assert nvml.started == 0  # NVML shut down after each read


def test_no_nvidia_driver_is_unknown_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    nvml = ProcessNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    reader = probe(nvml)
    with caplog.at_level(logging.DEBUG, "desktop_worker.owner.probes"):
        for _ in range(3):
            assert reader.read(Wants(gpu=True)).gpu_others_pct is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no NVIDIA driver" in warnings[0].getMessage()


def test_a_process_list_nvml_refuses_is_unknown_not_a_crash() -> None:
    nvml = ProcessNvml([(8 * GIB, [(9, GIB)], [], 40)], list_error=True)
    assert probe(nvml).read(Wants(gpu=True)).gpu_others_pct == 0  # nothing listed: nobody


@pytest.mark.parametrize(("battery", "on_battery"), [
    (None, False),  # no battery: a desktop
    (SimpleNamespace(percent=80, secsleft=3600, power_plugged=False), True),
    (SimpleNamespace(percent=80, secsleft=-2, power_plugged=True), False),
    (SimpleNamespace(percent=80, secsleft=-2, power_plugged=None), None),  # cannot tell
])
def test_battery(battery: Any, on_battery: bool | None) -> None:
    assert probe(battery=lambda: battery).read(Wants(battery=True)).on_battery is on_battery


def test_every_probe_failure_is_unknown_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Any:
        raise OSError("/sys/class/power_supply is unreadable")

    def xprop_hangs(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.TimeoutExpired("xprop", 2)

    reader = probe(ProcessNvml([], init_error=999), battery=broken, run=xprop_hangs,
                   environ={"DISPLAY": ":0"}, platform="linux")
    with caplog.at_level(logging.WARNING, "desktop_worker.owner.probes"):
        first = reader.read(ALL)
        reader.read(ALL)
    assert (first.on_battery, first.gpu_others_pct, first.fullscreen) == (None, None, None)
    said = [r.getMessage() for r in caplog.records]
    assert sum("battery" in m for m in said) == 1
    assert sum("NVML failed" in m for m in said) == 1


def test_nothing_is_read_that_the_settings_do_not_need() -> None:
    calls: list[str] = []
    reader = probe(ProcessNvml([], init_error=999),
                   battery=lambda: calls.append("battery"),
                   run=lambda *a, **k: calls.append("xprop"), environ={"DISPLAY": ":0"})
    assert reader.read(Wants()) == reader.read(Wants())
    assert calls == []


ROOT = "_NET_ACTIVE_WINDOW(WINDOW): window id # 0x3a00007\n"
FULLSCREEN_WINDOW = (
    "_NET_WM_STATE(ATOM) = _NET_WM_STATE_FULLSCREEN, _NET_WM_STATE_FOCUSED\n"
    'WM_CLASS(STRING) = "Navigator", "firefox"\n'
    '_NET_WM_NAME(UTF8_STRING) = "A film - Mozilla Firefox"\n')
NORMAL_WINDOW = ("_NET_WM_STATE(ATOM) = _NET_WM_STATE_MAXIMIZED_VERT\n"
                 'WM_CLASS(STRING) = "gnome-terminal-server", "Gnome-terminal"\n')


def xprop(answers: dict[str, str]) -> Any:
    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert cmd[0] == "xprop"
        assert kwargs["timeout"] > 0
        return subprocess.CompletedProcess(cmd, 0, answers[cmd[1]], "")
    return run


@pytest.mark.parametrize(("root", "window", "expected"), [
    (ROOT, FULLSCREEN_WINDOW, (True, "firefox")),
    (ROOT, NORMAL_WINDOW, (False, "Gnome-terminal")),
    ("_NET_ACTIVE_WINDOW(WINDOW): window id # 0x0\n", "", (False, None)),  # no active window
    ("_NET_ACTIVE_WINDOW:  not found.\n", "", (False, None)),
])
def test_full_screen_on_x11(monkeypatch: pytest.MonkeyPatch, root: str, window: str,
                            expected: tuple) -> None:
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    reader = probe(run=xprop({"-root": root, "-id": window}), environ={"DISPLAY": ":0"},
                   platform="linux")
    got = reader.read(Wants(fullscreen=True))
    assert (got.fullscreen, got.fullscreen_app) == expected


def test_full_screen_is_unknown_without_x11_or_windows(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "desktop_worker.owner.probes"):
        got = probe(platform="darwin", environ={}).read(Wants(fullscreen=True))
    assert got.fullscreen is None
    assert "supported: X11 with xprop, and Windows" in caplog.text


def test_a_window_title_stands_in_for_a_missing_class() -> None:
    text = '_NET_WM_STATE(ATOM) = _NET_WM_STATE_FULLSCREEN\n_NET_WM_NAME(UTF8_STRING) = "Game"\n'
    assert parse_x11_window(text) == (True, "Game")


def test_the_default_probe_is_real_only_when_a_reading_is_needed(tmp_path) -> None:
    on = WorkerSettings(models_dir=tmp_path)  # pause on battery: on by default
    assert isinstance(default_probe(on), SystemProbe)
    off = WorkerSettings(models_dir=tmp_path, pause_on_battery=False, active_hours="9:00-17:00")
    assert isinstance(default_probe(off), NullProbe)
