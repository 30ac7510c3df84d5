"""The Hardware tab's "Engine sandbox" box and the notice of a crashed engine (issue 34): in
the owner's words, from what the engine's own process found (``Confinement``); in the app, from
the real device probe's sandboxed process."""

from __future__ import annotations

import sys

import pytest
from PySide6.QtWidgets import QLabel

from desktop_worker.groups.rpc_probe import SandboxedRpc
from desktop_worker.gui.notify import NotificationPolicy
from desktop_worker.gui.services.sandbox import sandbox_summary
from desktop_worker.gui.views.hardware import HardwareView
from shared_schema.engine_ipc import Confinement
from tests.desktop_worker.gui.conftest import open_app, until

WHOLE = Confinement(os="linux", no_new_privs=True, seccomp=True, landlock_abi=7,
                    filesystem=True, network=True, tcp_ports=True, signals=True,
                    memory_limit_mb=2048, rlimits=True, capabilities_dropped=True)


def test_a_whole_sandbox_reads_as_what_models_cannot_do() -> None:
    summary = sandbox_summary(WHOLE)
    assert summary.holds
    assert "cannot read your files" in summary.headline
    rows = dict(summary.rows)
    assert rows["Reads your files (keys, documents)"] == "no"
    assert rows["Opens network connections"] == "no"
    assert rows["Runs programs or new processes"] == "no"
    assert rows["Model groups"].startswith("allowed")


def test_an_old_kernel_says_what_is_missing_and_keeps_groups_off() -> None:
    old = WHOLE.model_copy(update={"landlock_abi": 0, "filesystem": False, "tcp_ports": False,
                                   "signals": False, "notes": ["this kernel has no Landlock"]})
    summary = sandbox_summary(old)
    assert not summary.holds
    assert "part of the sandbox is missing" in summary.headline
    assert dict(summary.rows)["Reads your files (keys, documents)"] == "not prevented"
    assert dict(summary.rows)["Model groups"].startswith("off")
    assert summary.notes == ["this kernel has no Landlock"]


def test_another_system_says_plainly_that_only_the_process_is_separate() -> None:
    summary = sandbox_summary(Confinement(os="win32", notes=["no sandbox on win32 yet"]))
    assert not summary.holds
    assert "separate process" in summary.headline
    assert "Model groups are off" in summary.headline
    assert sandbox_summary(None, checked=True).headline.startswith("The engine's sandbox could "
                                                                  "not be checked")


def test_a_crashed_engine_is_told_once_in_a_while() -> None:
    policy = NotificationPolicy(crash_every_s=600)
    notice = policy.engine_crashed("smol", "it crashed (a segmentation fault) (SIGSEGV)", 100.0)
    assert notice is not None
    assert notice.level == "warning"
    assert "smol" in notice.message
    assert "segmentation fault" in notice.message
    assert "keeps earning" in notice.message
    assert policy.engine_crashed("smol", "again", 200.0) is None  # a crash loop: told once
    assert policy.engine_crashed("smol", "later", 800.0) is not None


def test_the_view_shows_the_rows(qtbot) -> None:
    view = HardwareView()
    qtbot.addWidget(view)
    view.show_sandbox(sandbox_summary(WHOLE))
    view.show_sandbox(sandbox_summary(WHOLE))  # shown again: the rows are replaced, not added
    labels = [label.text() for label in view.sandbox_box.findChildren(QLabel)]
    assert view.sandbox.holds
    assert labels.count("Opens network connections") == 1
    assert labels[0].startswith("Models run in sandboxed processes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux sandbox")
async def test_the_app_shows_what_its_real_probe_found(settings_for) -> None:
    rpc = SandboxedRpc()
    async with open_app(settings_for(), rpc=rpc) as app:
        app.launch(show=False)
        await until(lambda: rpc.confinement is not None and
                    app.hardware_view.sandbox.rows != [], 60, "the probe's engine process")
        assert app.hardware_view.sandbox.holds == rpc.confinement.holds
        assert rpc.confinement.seccomp
