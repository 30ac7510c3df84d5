"""Real queen and worker processes for end-to-end tests (and the benchmark)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Proc:
    """A child process whose combined output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.args = args
        self.log_path = log_path
        self.env = env
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                      env=self.env)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, kill: bool = False) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            if kill:
                self.popen.kill()
            else:
                self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def base_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(tmp / "hf-home"),
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("HF_TOKEN", None)
    return env


def queen_process(tmp: Path, port: int, **settings: str) -> Proc:
    env = base_env(tmp)
    env["APIARY_AUTH"] = "open"
    env.update({f"APIARY_{key.upper()}": value for key, value in settings.items()})
    args = [sys.executable, "-m", "queen_server.cli", "--port", str(port), "--log-level",
            "warning", "--db", f"sqlite+aiosqlite:///{tmp / 'queen.sqlite3'}"]
    return Proc(args, tmp / f"queen-{port}.log", env)


def worker_process(tmp: Path, queen_port: int, models: list[str], *extra: str,
                   hf_endpoint: str | None = None) -> Proc:
    env = base_env(tmp)
    env["APIARY_KEY_PATH"] = str(tmp / "worker-key.pem")
    if hf_endpoint:
        env["HF_ENDPOINT"] = hf_endpoint
    args = [sys.executable, "-m", "desktop_worker.cli", "--headless",
            "--queen", f"ws://127.0.0.1:{queen_port}/worker", "--models-dir",
            str(tmp / "models"), *extra]
    for model in models:
        args += ["--model", model]
    return Proc(args, tmp / "worker.log", env)


def queen_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``apiary-queen ARGS`` on the SQLite database ``queen_process(tmp, ...)`` uses."""
    env = base_env(tmp)
    env["APIARY_DB"] = f"sqlite+aiosqlite:///{tmp / 'queen.sqlite3'}"
    return subprocess.run([sys.executable, "-m", "queen_server.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def health(port: int) -> dict:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in reversed(procs):
            proc.stop()


def engine_children(pid: int | None = None) -> list[psutil.Process]:
    """The live engine children (``python -m desktop_worker.engine_child``, or the frozen app's
    ``--engine-child``) of the process ``pid`` (None: this one), at any depth; a child that
    ended meanwhile is left out."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            command = child.cmdline()
            if child.status() != psutil.STATUS_ZOMBIE and (
                    "desktop_worker.engine_child" in command or "--engine-child" in command):
                found.append(child)
        except psutil.Error:
            continue
    return found
