"""The Hardware tab's serving figures (issue 36): each loaded model's jobs at once, the jobs
running now and tokens/s per stream and in total, from the records behind the Jobs tab; the
arithmetic on made-up records, the box offscreen, and the real app serving the real SmolLM2
four at a time through a real queen."""

from __future__ import annotations

import asyncio

import pytest
from PySide6.QtWidgets import QLabel

from desktop_worker.gui.services.serving import (
    IDLE,
    MEASURING,
    NOT_EARNING,
    NOTHING_LOADED,
    FinishedJob,
    ServingLog,
    busy_seconds,
    loaded_slots,
    serving_figures,
    serving_headline,
    serving_rows,
)
from desktop_worker.gui.services.worker import JobStart
from desktop_worker.gui.views.hardware import HardwareView
from desktop_worker.jobs import JobRecord
from tests.desktop_worker.gui.conftest import MODEL, MODEL_NAME, open_app, until
from tests.support.queen import running_queen

NOW = 1000.0
SMOL = "smol"


def job(ended_ago_s: float, seconds: float, tokens: int, model: str = SMOL) -> FinishedJob:
    return FinishedJob(model, NOW - ended_ago_s, seconds, tokens)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


# --- the arithmetic ------------------------------------------------------------------------------


def test_one_stream_reads_its_own_speed_per_stream_and_in_total() -> None:
    figures = serving_figures(SMOL, 1, 0, [job(10, 4.0, 100)], NOW)
    assert figures.per_stream_tps == pytest.approx(25.0)
    assert figures.total_tps == pytest.approx(25.0)
    assert figures.jobs_measured == 1
    rows = dict(serving_rows(figures))
    assert rows == {"Jobs at once": "1", "Running now": "0 of 1",
                    "Per stream": "25.0 tokens/s",
                    "In total": "25.0 tokens/s (1 job in the last minute)"}


def test_four_streams_side_by_side_add_up_in_total() -> None:
    side_by_side = [job(5, 4.0, 100) for _ in range(4)]
    figures = serving_figures(SMOL, 4, 0, side_by_side, NOW)
    assert figures.per_stream_tps == pytest.approx(25.0)
    assert figures.total_tps == pytest.approx(100.0)
    assert dict(serving_rows(figures))["In total"] == \
        "100.0 tokens/s (4 jobs in the last minute)"


def test_four_jobs_one_after_the_other_do_not_add_up() -> None:
    """A naive sum of the last minute's speeds would read 100 tokens/s for one stream's work."""
    in_a_row = [job(5 + 4 * n, 4.0, 100) for n in range(4)]
    figures = serving_figures(SMOL, 4, 0, in_a_row, NOW)
    assert figures.per_stream_tps == pytest.approx(25.0)
    assert figures.total_tps == pytest.approx(25.0)


def test_streams_of_unequal_length_weigh_by_their_time() -> None:
    # Three answers of 100 tokens in 10 s and one of 50 in 5 s, all started together: 40
    # tokens/s while four ran, 30 while three did, 35 over the 10 s; each stream 10 tokens/s.
    jobs = [job(0, 10.0, 100) for _ in range(3)] + [job(5, 5.0, 50)]
    figures = serving_figures(SMOL, 4, 0, jobs, NOW)
    assert figures.per_stream_tps == pytest.approx(10.0)
    assert figures.total_tps == pytest.approx(35.0)
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert busy_seconds([]) == 0.0


def test_only_this_models_generations_of_the_last_minute_count() -> None:
    others = [job(61, 1.0, 500),  # ended over a minute ago
              job(5, 2.0, 500, model="other"),  # another model's
              job(5, 0.3, 0)]  # an embedding or an audit's score: no tokens generated
    figures = serving_figures(SMOL, 2, 1, [*others, job(5, 4.0, 40)], NOW)
    assert figures.jobs_measured == 1
    assert figures.per_stream_tps == pytest.approx(10.0)
    assert figures.total_tps == pytest.approx(10.0)


def test_no_jobs_reads_idle_and_running_jobs_are_measured_when_they_end() -> None:
    idle = serving_figures(SMOL, 8, 0, [job(61, 4.0, 100)], NOW)
    assert idle.per_stream_tps is None
    assert idle.total_tps is None
    rows = dict(serving_rows(idle))
    assert rows["Per stream"] == rows["In total"] == IDLE
    assert rows["Running now"] == "0 of 8"
    assert "idle" in IDLE
    busy = dict(serving_rows(serving_figures(SMOL, 8, 3, [], NOW)))
    assert busy["Running now"] == "3 of 8"
    assert busy["Per stream"] == MEASURING


def test_the_headline_says_why_there_is_nothing_to_show() -> None:
    assert loaded_slots(None, earning=False) is None
    assert loaded_slots(None, earning=True) == {}  # started, the worker not built yet
    assert serving_headline(None) == NOT_EARNING
    assert serving_headline({}) == NOTHING_LOADED
    assert serving_headline({SMOL: 4}) == ""


def test_the_log_follows_jobs_and_forgets_what_is_over_a_minute_old() -> None:
    clock = Clock()
    log = ServingLog(clock)
    for n in range(3):
        log.started(JobStart(f"j{n}", SMOL, "chat", 0.0))
    log.started(JobStart("e", "other", "embeddings", 0.0))
    [figures] = log.figures({SMOL: 4})
    assert (figures.running, figures.jobs_measured) == (3, 0)
    clock.now += 4
    for n in range(2):
        log.finished(JobRecord(f"j{n}", SMOL, "chat", 10, 100, 4.0, "ok"))
    [figures] = log.figures({SMOL: 4})
    assert figures.running == 1
    assert figures.total_tps == pytest.approx(50.0)
    assert figures.per_stream_tps == pytest.approx(25.0)
    clock.now += 61
    [figures] = log.figures({SMOL: 4})
    assert figures.per_stream_tps is None  # a minute on: idle again
    log.stopped()  # the worker stopped: what it was running will never report
    assert log.running(SMOL) == 0
    assert [f.model for f in log.figures({"b": 1, "a": 2})] == ["a", "b"]


# --- the box -------------------------------------------------------------------------------------


def texts(view: HardwareView) -> list[str]:
    return [label.text() for label in view.serving_box.findChildren(QLabel)]


def test_the_box_shows_each_model_and_a_hostile_name_as_plain_text(qtbot) -> None:
    view = HardwareView()
    qtbot.addWidget(view)
    assert NOT_EARNING in texts(view)  # before any start
    hostile = '<img src="http://attacker.example/x.png">smol'
    measured = [job(5, 4.0, 100, model=hostile) for _ in range(4)]
    figures = [serving_figures(hostile, 4, 2, measured, NOW),
               serving_figures("idle-one", 1, 0, [], NOW)]
    view.show_serving("", figures)
    shown = texts(view)
    assert NOT_EARNING not in shown
    assert hostile in shown
    name = next(label for label in view.serving_box.findChildren(QLabel)
                if label.text() == hostile)
    assert name.textFormat().name == "PlainText"
    for wanted in ("Jobs at once", "4", "Running now", "2 of 4", "Per stream", "25.0 tokens/s",
                   "In total", "100.0 tokens/s (4 jobs in the last minute)", "idle-one", IDLE):
        assert wanted in shown, wanted
    view.show_serving(NOTHING_LOADED, [])  # figures replaced, not stacked
    assert texts(view) == [NOTHING_LOADED]


# --- the app, serving the real model four at a time ----------------------------------------------

SLOW_MACHINE = {"first_token_timeout_s": 60.0, "total_timeout_s": 120.0}
PROMPTS = ["Name three colours.", "What is the capital of France?", "Say hello in Spanish.",
           "Name a planet."]


@pytest.mark.timeout(240)  # four real answers at once on 2 cores: slow when the machine is busy
async def test_the_hardware_tab_shows_four_jobs_served_at_once(tmp_path, settings_for, qtbot):
    async with (running_queen(tmp_path, **SLOW_MACHINE) as queen,
                open_app(settings_for(queen_url=queen.ws_url, max_jobs=4)) as app):
        await asyncio.to_thread(app.models.store.import_file, MODEL, MODEL_NAME)
        app.launch()
        view = app.hardware_view
        assert NOT_EARNING in texts(view)
        app.controller.start()
        await until(lambda: app.controller.link_state == "connected", 30, "connected")
        await queen.wait_until(lambda: MODEL_NAME in queen.state.registry.model_names(), 10)
        client = queen.client(timeout=120)
        seen_running: list[int] = []
        app.controller.job_started.connect(
            lambda _start: seen_running.append(app.serving.running(MODEL_NAME)))
        answers = await asyncio.gather(*(
            client.chat.completions.create(model=MODEL_NAME, max_tokens=48, temperature=0,
                                           messages=[{"role": "user", "content": prompt}])
            for prompt in PROMPTS))
        assert all(answer.usage.completion_tokens > 0 for answer in answers)
        await until(lambda: app.serving.running(MODEL_NAME) == 0
                    and [f.jobs_measured for f in view.serving] == [4], 20, "four jobs measured")
        assert max(seen_running) == 4  # all four ran at once in the model's batch
        [figures] = view.serving
        assert figures.model == MODEL_NAME
        assert figures.slots == app.controller.service.pool.slots(MODEL_NAME) == 4
        assert figures.per_stream_tps is not None
        assert figures.total_tps is not None
        # Side by side in one batch: the total is well over one stream's speed.
        assert figures.total_tps > 1.5 * figures.per_stream_tps
        shown = texts(view)
        assert MODEL_NAME in shown
        assert "0 of 4" in shown
        assert f"{figures.total_tps:,.1f} tokens/s (4 jobs in the last minute)" in shown
        await app.controller.stop_and_wait()
        await until(lambda: NOT_EARNING in texts(view), 10, "the figures gone at the stop")
