"""The worker's handle on one engine child: spawn it, speak the engine protocol to it through
``ipc.EngineLink``, read its log, and tell what happened when it ends.

The child gets a socket pair's other end (``APIARY_ENGINE_FD``), a scratch folder of its own as
its working folder, home and temporary folder, and an environment stripped of everything but
what its runtimes read (no tokens, no ``APIARY_*`` settings, no proxy credentials). It starts
in a new session and dies with the worker (``PR_SET_PDEATHSIG`` in the child). Its stdout and
stderr come back through one pipe: each line is logged (at most ``LOG_LINES_PER_MINUTE``, so a
child cannot flood the owner's log) and the last ones are kept to say why it ended.

Blocking, for the pool's threads: one thread talks to a child at a time (``busy`` in the
contexts that own one); ``kill`` may come from any thread.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from desktop_worker.errors import EngineCrashed, EngineProtocolError, SandboxError
from desktop_worker.sandbox.ipc import EngineLink
from shared_schema.engine_ipc import Confinement, Hello, Role, SandboxPolicy

log = logging.getLogger(__name__)

FD_VARIABLE = "APIARY_ENGINE_FD"  # the child's end of the socket pair
ADDRESS_VARIABLE = "APIARY_ENGINE_ADDRESS"  # the "tcp" transport (Windows): where to dial
TOKEN_VARIABLE = "APIARY_ENGINE_TOKEN"  # and the one-time token to prove itself with
TOKEN_BYTES = 32
ENGINE_CHILD_FLAG = "--engine-child"  # the frozen app's entry point starts a child with it
START_TIMEOUT_S = 60.0  # a fresh Python importing numpy, jinja2 and llama.cpp on a slow disk
# A child's scratch folder (the only place it may write) is held to this much disk and this many
# entries, checked every ``SCRATCH_CHECK_S``: past either, the child is stopped. Each file is
# also held to the policy's ``max_file_mb`` by the child's own rlimit.
SCRATCH_QUOTA_MB = 1024
SCRATCH_ENTRIES = 10_000
SCRATCH_CHECK_S = 1.0
READ_BYTES = 1 << 20
LOG_LINES_PER_MINUTE = 240
LAST_LINES = 40
MAX_LINE_CHARS = 2000
# What a child's runtimes read from the environment; everything else stays with the worker.
PASSED_ENV = (
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SYSTEMROOT", "WINDIR", "PYTHONPATH",
    "PYTHONHOME", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL", "VK_ICD_FILENAMES", "VK_DRIVER_FILES", "GGML_VK_VISIBLE_DEVICES",
    "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GGML_NO_BACKTRACE", "GGML_SCHED_MAX_COPIES",
    "QT_QPA_PLATFORM",
)


def child_command() -> list[str]:
    """How to start an engine child: this Python with ``-m``, or the frozen app with a flag
    its entry point reads (``installers/apiary_worker_main.py``)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, ENGINE_CHILD_FLAG]
    return [sys.executable, "-m", "desktop_worker.engine_child"]


def child_environment(scratch: str) -> dict[str, str]:
    env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
    env.update(HOME=scratch, TMPDIR=scratch, TMP=scratch, TEMP=scratch,
               PYTHONDONTWRITEBYTECODE="1", GGML_NO_BACKTRACE=os.environ.get(
                   "GGML_NO_BACKTRACE", "1"), PYTHONUNBUFFERED="1")
    return env


def printable(line: bytes) -> str:
    """A child's log line as the worker logs it: what llama.cpp prints is text, but a hostile
    model's bytes could be anything, so control characters (terminal escapes, carriage returns
    that hide the line before) become ``?``."""
    text = line.decode("utf-8", errors="replace").rstrip()
    return "".join(ch if ch.isprintable() or ch == "\t" else "?" for ch in text)


def scratch_problem(folder: str, quota_bytes: int, max_entries: int = SCRATCH_ENTRIES
                    ) -> str | None:
    """Why a child's scratch folder is over its quota (the disk its files really use, so a
    sparse file counts as what it holds), or None. The walk stops at ``max_entries``: a
    folder with more is over its quota too."""
    used = entries = 0
    stack = [folder]
    while stack:
        try:
            with os.scandir(stack.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        return f"it made more than {max_entries:,} files in its scratch folder"
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        stat = entry.stat(follow_symlinks=False)
                        blocks = getattr(stat, "st_blocks", None)  # POSIX: what is on disk
                        used += blocks * 512 if blocks is not None else stat.st_size
                    if used > quota_bytes:
                        return (f"it wrote more than {quota_bytes // 2**20:,} MB to its scratch "
                                "folder")
        except OSError:
            continue  # removed meanwhile
    return None


class _ScratchWatch(threading.Thread):
    """Stops a child whose scratch folder goes past its quota: the owner's disk is theirs."""

    def __init__(self, process: EngineProcess, quota_bytes: int) -> None:
        super().__init__(name=f"{process.label}-scratch", daemon=True)
        self.process = process
        self.quota_bytes = quota_bytes
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SCRATCH_CHECK_S):
            if not self.process.alive:  # a child that ended writes no more (closed or not)
                return
            problem = scratch_problem(self.process.scratch, self.quota_bytes)
            if problem is not None:
                log.error("%s was stopped: %s", self.process.label, problem)
                self.process.stopped_because = problem
                self.process.kill()
                return


def describe_exit(code: int | None) -> str:
    """A child's exit status in plain words."""
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = {"SIGSEGV": "it crashed (a segmentation fault)",
                "SIGABRT": "llama.cpp aborted it",
                "SIGKILL": "it was killed (out of memory, or stopped by the worker)",
                "SIGBUS": "it crashed (a bus error)",
                "SIGSYS": "it made a system call its sandbox forbids"}.get(name)
        return f"{what} ({name})" if what else f"it ended on {name}"
    return f"it exited with code {code}"


class _LogReader(threading.Thread):
    """A child's stdout and stderr: logged (rate-limited) and the last lines kept."""

    def __init__(self, stream: Any, label: str) -> None:
        super().__init__(name=f"{label}-log", daemon=True)
        self.stream = stream
        self.label = label
        self.last: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self.dropped = 0
        self._window_start = time.monotonic()
        self._in_window = 0

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while line := self.stream.readline(MAX_LINE_CHARS):
                text = printable(line)
                if not text:
                    continue
                self.last.append(text)
                now = time.monotonic()
                if now - self._window_start >= 60:
                    if self.dropped:
                        log.warning("%s: %d log lines dropped", self.label, self.dropped)
                    self._window_start, self._in_window, self.dropped = now, 0, 0
                self._in_window += 1
                if self._in_window <= LOG_LINES_PER_MINUTE:
                    log.info("%s: %s", self.label, text)
                else:
                    self.dropped += 1

    def last_words(self) -> str:
        """llama.cpp's reason, when it printed one (an assert, an error), else the last line."""
        lines = list(self.last)
        for line in reversed(lines):
            lowered = line.lower()
            if "ggml_assert" in lowered or "error" in lowered or "abort" in lowered:
                return line[:500]
        return lines[-1][:500] if lines else ""


class EngineProcess:
    """One engine child, started in the ``role`` under ``policy``."""

    def __init__(self, role: Role, policy: SandboxPolicy, *, label: str,
                 start_timeout_s: float = START_TIMEOUT_S, transport: str | None = None,
                 scratch_quota_mb: int = SCRATCH_QUOTA_MB) -> None:
        """``transport``: "socketpair" (POSIX: the child inherits its end) or "tcp" (Windows,
        which cannot pass a socket to a child that simply: the child dials a one-time
        listener on 127.0.0.1 and proves itself with a one-time token). The child's scratch
        folder is ``policy.scratch`` (a new one when the policy names none), held to
        ``scratch_quota_mb`` while the child runs and removed when it is closed."""
        self.role = role
        self.transport = transport or ("tcp" if os.name == "nt" else "socketpair")
        if policy.scratch is None:
            policy = policy.model_copy(update={"scratch": self.scratch_folder()})
        self.policy = policy
        self.label = label
        self.start_timeout_s = start_timeout_s
        self.link = EngineLink(role)
        self._scratch: str = policy.scratch or ""
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._log: _LogReader | None = None
        self._pending: list[Any] = []
        self._lock = threading.Lock()  # sends (a cancel comes from the job's thread too)
        self.confinement: Confinement | None = None
        self.stopped_because: str | None = None  # the worker stopped it, and why
        self._watch = _ScratchWatch(self, scratch_quota_mb * 2**20)

    @staticmethod
    def scratch_folder() -> str:
        return tempfile.mkdtemp(prefix="apiary-engine-")

    @property
    def scratch(self) -> str:
        return self._scratch

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._process.poll() if self._process else None

    def start(self) -> Hello:
        """Spawn the child, send ``start`` and wait for its hello (``SandboxError`` if it
        cannot start)."""
        env = child_environment(self._scratch)
        if self.transport == "tcp":
            self._sock = self._spawn_tcp(env)
        else:
            self._sock = self._spawn_pair(env)
        process = self._process
        assert process is not None
        assert process.stdout is not None
        self._log = _LogReader(process.stdout, f"{self.label}[{process.pid}]")
        self._log.start()
        self._watch.start()
        self.send(self.link.start(self.policy))
        hello = self.wait_for(self.start_timeout_s)
        if hello is None:
            self.kill()
            raise SandboxError(f"the engine process did not start within "
                               f"{self.start_timeout_s:.0f} s")
        self.confinement = hello.confinement
        return hello

    def _popen(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        try:
            self._process = subprocess.Popen(
                child_command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, cwd=self._scratch, env=env, pass_fds=pass_fds,
                start_new_session=os.name != "nt")
        except OSError as exc:
            raise SandboxError(f"the engine process could not start: {exc}") from exc

    def _spawn_pair(self, env: dict[str, str]) -> socket.socket:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env[FD_VARIABLE] = str(child.fileno())
        try:
            self._popen(env, (child.fileno(),))
        except SandboxError:
            parent.close()
            raise
        finally:
            child.close()
        return parent

    def _spawn_tcp(self, env: dict[str, str]) -> socket.socket:
        token = secrets.token_bytes(TOKEN_BYTES)
        with socket.create_server(("127.0.0.1", 0)) as listener:
            env[ADDRESS_VARIABLE] = f"127.0.0.1:{listener.getsockname()[1]}"
            env[TOKEN_VARIABLE] = token.hex()
            self._popen(env)
            listener.settimeout(self.start_timeout_s)
            deadline = time.monotonic() + self.start_timeout_s
            while True:  # someone else may dial the port first: only the token counts
                try:
                    sock, _ = listener.accept()
                except OSError as exc:
                    self.kill()
                    raise SandboxError("the engine process did not connect back") from exc
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    proof = sock.recv(TOKEN_BYTES, socket.MSG_WAITALL)
                except OSError:
                    proof = b""
                if hmac.compare_digest(proof, token):
                    sock.settimeout(None)
                    return sock
                sock.close()

    def send(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise self.crashed("it is not running")
        try:
            with self._lock:
                sock.sendall(data)
        except OSError as exc:
            raise self.crashed() from exc

    def wait_for(self, timeout_s: float | None) -> Any | None:
        """The child's next message, or None after ``timeout_s`` (None: wait as long as it
        lives). ``EngineCrashed`` when it ended; ``EngineProtocolError`` (after killing it)
        when it broke the protocol."""
        if self._pending:
            return self._pending.pop(0)
        sock = self._sock
        if sock is None:
            raise self.crashed("it is not running")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([sock], [], [], wait)
            if not ready:
                return None
            try:
                data = sock.recv(READ_BYTES)
            except OSError as exc:
                raise self.crashed() from exc
            if not data:
                raise self.crashed()
            try:
                self._pending.extend(self.link.receive(data))
            except EngineProtocolError as exc:
                self.kill()
                log.error("%s broke the engine protocol and was stopped: %s", self.label, exc)
                raise EngineProtocolError(str(exc), reason=f"the engine process was stopped: "
                                          f"{exc}") from exc
        return self._pending.pop(0)

    def crashed(self, detail: str | None = None) -> EngineCrashed:
        """What to raise when the child is gone: its exit and last words, in plain words."""
        process = self._process
        code = None
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=5)
        if self._log is not None:
            self._log.join(timeout=1)
        words = self._log.last_words() if self._log is not None else ""
        how = detail or self.stopped_because or describe_exit(code)
        reason = f"the engine process ended: {how}" + (f" ({words})" if words else "")
        return EngineCrashed(f"{self.label}: {reason}", reason=reason)

    def wait(self) -> int | None:
        """Until the child ends; its exit code (negative: the signal)."""
        return self._process.wait() if self._process is not None else None

    def kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Ask the child to stop, wait for it (then kill it), and remove its scratch folder."""
        sock, process = self._sock, self._process
        if sock is not None and process is not None and process.poll() is None:
            with contextlib.suppress(OSError), self._lock:
                sock.sendall(self.link.stop())
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout_s)
        self.kill()
        if sock is not None:
            sock.close()
        self._sock = None
        self._watch.done.set()
        if self._log is not None:
            self._log.join(timeout=2)
        if process is not None and process.stdout is not None:
            process.stdout.close()
        shutil.rmtree(self._scratch, ignore_errors=True)


class CancelWatch:
    """A long job's cancel as the worker carries it out (a training run, an image order):
    passed on to the child once, and the child killed if it has not stopped ``grace_s``
    later. ``check`` between two waits for the child's next message."""

    def __init__(self, process: EngineProcess, job: int, cancel: threading.Event,
                 grace_s: float) -> None:
        self.process = process
        self.job = job
        self.cancel = cancel
        self.grace_s = grace_s
        self.at: float | None = None  # when the cancel was passed on

    @property
    def cancelled(self) -> bool:
        return self.at is not None

    def check(self) -> bool:
        """Pass a new cancel on to the child; True once the grace ran out (the child killed)."""
        if self.cancel.is_set() and self.at is None:
            self.at = time.monotonic()
            frame = self.process.link.cancel(self.job)
            if frame is not None:
                with contextlib.suppress(EngineCrashed):
                    self.process.send(frame)
        if self.at is not None and time.monotonic() - self.at > self.grace_s:
            self.process.kill()
            return True
        return False
