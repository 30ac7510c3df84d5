"""Model groups in the app's status (issue 19): what a member or a head does for its group,
in words, read from the worker's real ``GroupRoles``; nothing when it is in no group or when a
pause, an error or the stop has more to say; a model name from the queen with markup in it
shown as plain text. End to end: a real worker on a real queen made a relayed member (its real
llama.cpp RPC server started) says "Serving 12 layers of … for a group" in the header and the
tray, and goes back to "waiting for jobs" when the group ends."""

from __future__ import annotations

from typing import Any

import pytest
from PySide6.QtCore import Qt

from desktop_worker.groups.roles import GroupPart, GroupRoles
from desktop_worker.gui.services.groups import (
    GroupStatus,
    GroupWatch,
    group_detail,
    group_status,
    short_model,
    tooltip_safe,
)
from desktop_worker.gui.services.worker import TrayState, status_text
from shared_schema import GroupLead, GroupLink, GroupMemberReady, GroupServe
from tests.desktop_worker.gui.conftest import open_app, until
from tests.desktop_worker.gui.test_live_state import add_tiny_model, start_earning
from tests.support.queen import running_queen

GROUP = "0123456789abcdef"
TOKEN = "5a" * 32
HOSTILE = '<b>Big</b><img src="http://127.0.0.1:9/t.png">'


async def _report(_message: Any) -> None:
    return None


def roles() -> GroupRoles:
    """Real roles; the pool and contexts are never reached by what the status reads."""
    return GroupRoles(None, None, lambda _name: None)  # type: ignore[arg-type]


def serve(model: str = "SmolLM2", layers: int = 12, route: str = "relayed") -> GroupServe:
    return GroupServe(group=GROUP, head="head-1", token=TOKEN, layers=layers, model=model,
                      route=route)


def lead(model: str = "SmolLM2", members: int = 2) -> GroupLead:
    links = [GroupLink(worker_id=f"m{i}", token=TOKEN, device_layers=[10])
             for i in range(members)]
    return GroupLead(group=GROUP, head="head-1", model=model, n_ctx=2048, head_layers=[10],
                     members=links)


def part(command: GroupServe | GroupLead, *, ready: bool = True) -> GroupPart:
    role = "member" if isinstance(command, GroupServe) else "head"
    return GroupPart(group=GROUP, role=role, report=_report, command=command, ready=ready)


# --- the words -----------------------------------------------------------------------------------


def test_no_group_says_what_it_always_said() -> None:
    worker = roles()
    assert group_status(worker) is None
    assert group_status(None) is None
    assert status_text(TrayState.IDLE, group_status(worker)) == "Earning: waiting for jobs"
    assert status_text(TrayState.WORKING, None) == "Earning: serving a job"


def test_a_member_says_how_many_layers_of_which_model_and_why_no_jobs_come() -> None:
    worker = roles()
    worker.part = part(serve(), ready=False)
    joining = group_status(worker)
    assert joining == GroupStatus(group=GROUP, role="member", model="SmolLM2", ready=False,
                                  layers=12, relayed=True)
    assert status_text(TrayState.IDLE, joining) == "Joining a group for SmolLM2…"
    worker.part.ready = True
    serving = group_status(worker)
    assert serving is not None
    assert status_text(TrayState.IDLE, serving) == "Serving 12 layers of SmolLM2 for a group"
    assert "takes no requests of its own" in group_detail(serving)
    assert "paid for the share" in group_detail(serving)
    worker.part = part(serve(layers=1, route="direct"))
    one = group_status(worker)
    assert one is not None
    assert not one.relayed
    assert status_text(TrayState.IDLE, one) == "Serving 1 layer of SmolLM2 for a group"


def test_a_head_says_how_many_workers_it_leads() -> None:
    worker = roles()
    worker.part = part(lead(members=2), ready=False)
    forming = group_status(worker)
    assert forming is not None
    assert forming.workers == 3
    assert status_text(TrayState.IDLE, forming) == "Setting up a group of 3 workers for SmolLM2…"
    worker.part.ready = True
    ready = group_status(worker)
    assert status_text(TrayState.IDLE, ready) == "Leading a group of 3 workers for SmolLM2"
    assert status_text(TrayState.WORKING, ready) == (
        "Leading a group of 3 workers for SmolLM2: serving a job")
    assert "across the group's computers" in group_detail(ready)  # type: ignore[arg-type]


def test_an_ended_part_is_no_group() -> None:
    worker = roles()
    worker.part = part(serve())
    worker.part.ended = True
    assert group_status(worker) is None


def test_a_part_without_its_command_still_says_something() -> None:
    worker = roles()
    worker.part = GroupPart(group=GROUP, role="head", report=_report, ready=True, model="smol")
    assert status_text(TrayState.IDLE, group_status(worker)) == "Leading a group for smol"
    worker.part = GroupPart(group=GROUP, role="member", report=_report, ready=True)
    assert status_text(TrayState.IDLE, group_status(worker)) == (
        "Serving part of a large model for a group")


@pytest.mark.parametrize("state", [TrayState.PAUSED, TrayState.ERROR, TrayState.STOPPED,
                                   TrayState.CONNECTING])
def test_a_pause_an_error_or_the_stop_outrank_the_group(state: TrayState) -> None:
    status = GroupStatus(group=GROUP, role="member", model="SmolLM2", ready=True, layers=12)
    assert status_text(state, status) == status_text(state, None)


def test_a_long_or_multiline_model_name_stays_on_one_short_line() -> None:
    name = "someone/" + "x" * 390 + "\n\nsecond line"
    shown = short_model(name)
    assert len(shown) == 48
    assert shown.endswith("…")
    assert "\n" not in shown
    assert short_model("  a \t b\n") == "a b"
    assert short_model("   ") == "a model"
    status = GroupStatus(group=GROUP, role="member", model=name, ready=True, layers=3)
    assert status_text(TrayState.IDLE, status) == f"Serving 3 layers of {shown} for a group"


def test_markup_in_a_tooltip_becomes_lookalikes() -> None:
    safe = tooltip_safe(HOSTILE + " & more")
    assert not set("<>&") & set(safe)
    assert "Big" in safe
    assert "img src" in safe


# --- the watch ------------------------------------------------------------------------------------


def test_the_watch_says_each_change_once_and_survives_a_broken_read(qtbot) -> None:
    worker = roles()
    watch = GroupWatch(lambda: group_status(worker), interval_ms=60_000)
    seen: list[GroupStatus | None] = []
    watch.changed.connect(seen.append)
    watch.start()
    assert seen == []  # no group, as before: nothing to say
    worker.part = part(serve(), ready=False)
    watch.poll()
    watch.poll()
    worker.part.ready = True
    watch.poll()
    assert [s.ready if s else None for s in seen] == [False, True]
    watch.read = lambda: 1 / 0  # type: ignore[assignment,return-value]
    watch.poll()  # logged, the last status kept
    assert watch.status is not None
    assert len(seen) == 2
    watch.stop()
    assert seen[-1] is None
    assert watch.status is None
    assert not watch.timer.isActive()


# --- in the app ----------------------------------------------------------------------------------


async def test_a_real_member_shows_in_the_header_and_the_tray_then_goes_back(
        tmp_path, settings_for, qtbot) -> None:
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url), group_poll_ms=50) as app):
        await start_earning(app, queen, tmp_path)
        header, tray = app.header, app.tray
        assert header.status.text() == "Earning: waiting for jobs"
        service = app.controller.service
        assert service is not None
        sent: list[Any] = []

        async def report(message: Any) -> None:
            sent.append(message)

        # As the link hands it the queen's frame: a relayed member starts its real RPC server.
        service.groups.receive(serve(model=HOSTILE, layers=12), report)
        await until(lambda: any(isinstance(m, GroupMemberReady) for m in sent), 60,
                    "the member's server to be ready")
        words = f"Serving 12 layers of {HOSTILE} for a group"
        # The whole words (a long name is elided on screen, whole in the tooltip).
        await until(lambda: header.status.full == words, 5, "the header to say it")
        assert header.status.textFormat() == Qt.TextFormat.PlainText  # the markup, literally
        assert "takes no requests of its own" in header.detail.text()
        tip = tray.icon.toolTip()
        assert tooltip_safe(words) in tip
        assert "<" not in tip
        tray.rebuild()
        assert tray.actions["group"].text() == tooltip_safe(words)
        assert not tray.actions["group"].isEnabled()

        await service.groups.end(GROUP, "the test is over")
        await until(lambda: header.status.text() == "Earning: waiting for jobs", 5, "back")
        assert "takes no requests" not in header.detail.text()
        assert "Serving" not in tray.icon.toolTip()
        tray.rebuild()
        assert "group" not in tray.actions


async def test_a_head_shows_in_the_header_and_the_stop_clears_it(settings_for, tmp_path,
                                                                 qtbot) -> None:
    async with (running_queen(tmp_path) as queen,
                open_app(settings_for(queen_url=queen.ws_url), group_poll_ms=50) as app):
        add_tiny_model(app, tmp_path)
        app.launch()
        app.controller.start()
        await until(lambda: app.controller.state == TrayState.IDLE, 30, "earning")
        service = app.controller.service
        assert service is not None
        service.groups.part = part(lead(model="SmolLM2", members=3))  # as _lead leaves it
        words = "Leading a group of 4 workers for SmolLM2"
        await until(lambda: app.header.status.text() == words, 5, "the header to say it")
        assert words in app.tray.icon.toolTip()
        service.groups.part = None
        await app.controller.stop_and_wait()
        assert app.controller.group is None
        assert app.header.status.text() == "Not earning"
