"""The queen stays lean: starting and stopping it loads no worker or desktop library.

``pip install 'apiary[queen]'`` installs no Qt, no llama-cpp-python and no pyopencl, so a queen
that imported one of them, even lazily on start-up, would crash on a server. A real
``python -m queen_server.cli`` process starts (migrations, billing, stats, payouts, uvicorn),
answers ``/health``, stops on SIGTERM, and reports every module it loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.module_census import STOPPED_BY_SIGTERM, loaded_packages, with_census
from tests.support.processes import free_port, health, queen_process, running, wait_for

#: What only the worker's side installs (huggingface_hub is the queen's too now: it reads hub
#: models' GGUF headers to price them) (apiary[worker], apiary[desktop]), and the worker itself.
WORKER_SIDE = {
    "PySide6",
    "shiboken6",
    "qasync",
    "llama_cpp",
    "pyopencl",
    "pynvml",
    "gguf",
    "keyring",
    "desktop_worker",
}


@pytest.mark.timeout(180)  # a cold interpreter on a busy CI machine
def test_the_queen_starts_serves_and_stops_without_worker_libraries(tmp_path: Path) -> None:
    port = free_port()
    census = tmp_path / "modules.json"
    queen = queen_process(tmp_path, port)
    queen.args[queen.args.index("--log-level") + 1] = "info"  # uvicorn's lifespan lines
    queen = with_census(queen, census).start()
    with running(queen):
        wait_for(lambda: health(port).get("status") == "ok" or not queen.alive(), 120,
                 "the queen's /health")
        assert queen.alive(), queen.log()
        assert queen.stop() == STOPPED_BY_SIGTERM, queen.log()
    log = queen.log()
    assert "Application startup complete." in log, log  # the lifespan started (migrations...)
    assert "Application shutdown complete." in log, log  # and stopped without an error
    assert "Traceback" not in log, log

    loaded = loaded_packages(census)
    assert {"queen_server", "uvicorn", "fastapi", "sqlalchemy"} <= loaded  # it really ran
    assert not loaded & WORKER_SIDE, sorted(loaded & WORKER_SIDE)
