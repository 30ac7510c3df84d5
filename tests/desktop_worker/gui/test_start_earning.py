"""Start Earning against a real queen, serving the real SmolLM2 model to the openai SDK."""

from __future__ import annotations

import asyncio
import time

from openai import AsyncOpenAI
from PySide6.QtCore import Qt

from tests.desktop_worker.gui.conftest import MODEL, MODEL_NAME, open_app, until
from tests.support.processes import free_port, health, queen_process, running, wait_for
from tests.support.queen import running_queen

# These 2-core machines are shared: give a real generation time before the queen gives up.
SLOW_MACHINE = {"first_token_timeout_s": 60.0, "total_timeout_s": 120.0}
PROMPT = [{"role": "user", "content": "Name three colours."}]


async def connect(app, queen, qtbot):
    await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
    app.launch()
    states: list[str] = []
    app.controller.state_changed.connect(lambda state, _detail: states.append(state))
    assert app.header.toggle.text() == "Start Earning"
    qtbot.mouseClick(app.header.toggle, Qt.MouseButton.LeftButton)
    await until(lambda: app.controller.link_state == "connected", 30, "connected")
    assert app.header.toggle.text() == "Stop"
    assert app.tray.state == "idle"
    await queen.wait_until(lambda: MODEL_NAME in queen.state.registry.model_names(), 5)
    return states


async def test_start_earning_serves_a_real_job(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path, **SLOW_MACHINE) as queen,
                open_app(settings_for(queen_url=queen.ws_url)) as app):
        states = await connect(app, queen, qtbot)
        answer = await queen.client().chat.completions.create(
            model=MODEL_NAME, messages=PROMPT, max_tokens=24, temperature=0)
        assert answer.choices[0].message.content.strip()
        jobs = app.window.jobs
        await until(lambda: jobs.model.rowCount() == 1
                    and jobs.cell(jobs.model.job_ids[0], "Outcome") == "ok", 10, "the job's row")
        job_id = jobs.model.job_ids[0]
        assert job_id.startswith(answer.id)
        assert jobs.cell(job_id, "Model") == MODEL_NAME
        assert jobs.cell(job_id, "Completion tokens") == str(answer.usage.completion_tokens)
        assert jobs.cell(job_id, "Prompt tokens") == str(answer.usage.prompt_tokens)
        # The tray went to working while the job ran, and back to idle after it.
        assert "working" in states
        assert states[-1] == "idle"
        assert app.tray.state == "idle"
        assert "idle" in app.tray.icon.toolTip().lower() or "waiting" in app.tray.icon.toolTip()
        # The first job served is announced once.
        assert [n.title for n in app.tray.notices if n.title == "First job served"] == [
            "First job served"]
        # Stop: the worker leaves the queen and the tray goes to stopped.
        qtbot.mouseClick(app.header.toggle, Qt.MouseButton.LeftButton)
        await until(lambda: not app.controller.running, 20, "stopped")
        assert app.tray.state == "stopped"
        await queen.wait_until(lambda: MODEL_NAME not in queen.state.registry.model_names(), 5)


async def test_the_event_loop_never_stalls_while_a_job_runs(tmp_path, settings_for, qapp):
    # The queen runs in its own process here, so the loop measured is the app's alone.
    port = free_port()
    queen = queen_process(tmp_path, port, first_token_timeout_s="60", total_timeout_s="120")
    with running(queen.start()):
        await asyncio.to_thread(wait_for, lambda: health(port).get("status") == "ok", 30,
                                "the queen")
        async with open_app(settings_for(queen_url=f"ws://127.0.0.1:{port}/worker")) as app:
            gaps = await measure_a_job(app, port)
        assert len(gaps) > 20  # the watcher really ran through the job
        assert max(gaps) < 0.100, f"the event loop stalled for {max(gaps) * 1000:.0f} ms"


async def measure_a_job(app, port: int) -> list[float]:
    """The event loop's gaps (s) between 5 ms ticks while the app serves one real job."""
    await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
    app.launch()
    app.header.toggle.click()
    await until(lambda: app.controller.link_state == "connected", 30, "connected")
    gaps: list[float] = []
    done = asyncio.Event()

    async def watch() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    watcher = asyncio.create_task(watch())
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           timeout=120) as client:
        answer = await client.chat.completions.create(
            model=MODEL_NAME, messages=PROMPT, max_tokens=48, temperature=0)
    done.set()
    await watcher
    assert answer.usage.completion_tokens > 0
    assert app.window.jobs.served == 1
    return gaps
