"""An engine child built for the sandbox's tests: it confines itself exactly as a real engine
child does (``desktop_worker.sandbox.confine.confine`` with the policy it is given), then does
what a model that took over llama.cpp would try, and prints what each attempt got as JSON.

    python tests/support/hostile_engine.py ROLE POLICY_JSON TARGETS_JSON

``TARGETS_JSON`` names what to try: ``key`` (a file to read: the worker's key), ``outside``
(a file to write outside the scratch folder), ``model`` (a file it may read), ``port`` (a TCP
port on 127.0.0.1 to dial), ``unix`` (a Unix socket to dial), ``parent`` (a pid to signal and
whose environment to read). Each result is "ok" or the error's name (``PermissionError``...).
"""

from __future__ import annotations

import json
import os
import socket
import sys


def attempt(action) -> str:  # type: ignore[no-untyped-def]
    try:
        action()
    except BaseException as exc:
        return type(exc).__name__
    return "ok"


def main() -> None:
    role, policy_json, targets_json = sys.argv[1:4]
    from desktop_worker.sandbox.confine import confine
    from shared_schema.engine_ipc import SandboxPolicy

    policy = SandboxPolicy.model_validate_json(policy_json)
    targets = json.loads(targets_json)
    results: dict[str, str] = {}
    driver = _FakeDriver(results, targets) if targets.get("driver") else None
    confinement = confine(policy, role)  # type: ignore[arg-type]
    if driver is not None:
        driver.after_lock()
    scratch = policy.scratch or "."

    def read(path: str) -> None:
        with open(path, "rb") as handle:
            handle.read(16)

    def write(path: str) -> None:
        with open(path, "w") as handle:
            handle.write("written by a hostile engine")

    results["read_key"] = attempt(lambda: read(targets["key"]))
    results["read_model"] = attempt(lambda: read(targets["model"]))
    results["list_home"] = attempt(lambda: os.listdir(targets["home"]))
    results["write_outside"] = attempt(lambda: write(targets["outside"]))
    results["write_scratch"] = attempt(lambda: write(os.path.join(scratch, "mine.txt")))
    results["shell"] = attempt(lambda: os.execv("/bin/sh", ["/bin/sh", "-c", "true"]))
    results["fork"] = attempt(lambda: os.waitpid(_fork(), 0))
    results["thread"] = attempt(_thread)

    def dial() -> None:
        with socket.create_connection(("127.0.0.1", targets["port"]), timeout=5):
            pass

    def dial_unix() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(targets["unix"])

    def listen() -> None:
        with socket.create_server(("127.0.0.1", 0)):
            pass

    results["dial_tcp"] = attempt(dial)
    results["dial_unix"] = attempt(dial_unix)
    results["listen"] = attempt(listen)
    results["udp"] = attempt(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())
    results["signal_parent"] = attempt(lambda: os.kill(targets["parent"], 0))
    results["parent_environ"] = attempt(lambda: read(f"/proc/{targets['parent']}/environ"))
    results["parent_memory"] = attempt(lambda: read(f"/proc/{targets['parent']}/mem"))

    def raise_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (65536, 65536))

    results["raise_rlimit"] = attempt(raise_limit)

    def allocate() -> None:
        limit = policy.memory_mb or 0
        block = bytearray((limit + 512) * 1024 * 1024)  # past its limit
        block[-1] = 1

    if policy.memory_mb is not None:
        results["allocate_past_limit"] = attempt(allocate)

    def sysv_shared_memory() -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.shmget(0, 1 << 20, 0o1600) < 0:  # IPC_PRIVATE, IPC_CREAT | 0600
            raise OSError(ctypes.get_errno(), "shmget")

    def shared_anonymous() -> None:
        import mmap

        mmap.mmap(-1, 1 << 20).close()  # MAP_SHARED | MAP_ANONYMOUS

    # Memory the data limit does not count: refused, so the limit holds.
    results["sysv_shm"] = attempt(sysv_shared_memory)
    results["shared_anonymous"] = attempt(shared_anonymous)
    results["memfd"] = attempt(lambda: os.close(os.memfd_create("more")))
    # What a GPU driver does in cuInit (allowed only with ``gpu_driver``), and what it must
    # not open the way to.
    results["name_own_thread"] = attempt(_name_own_thread)
    results["name_parent"] = attempt(lambda: write(f"/proc/{targets['parent']}/comm"))
    results["parent_oom_score"] = attempt(
        lambda: write(f"/proc/{targets['parent']}/oom_score_adj"))
    results["socketpair"] = attempt(lambda: [end.close() for end in socket.socketpair()])
    results["unix_socket"] = attempt(
        lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())

    def bind_abstract() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind("\0apiary-hostile-engine")
            sock.listen()

    results["bind_abstract"] = attempt(bind_abstract)
    report = {"confinement": confinement.model_dump(), "results": results}
    sys.stdout.write(json.dumps(report) + "\n")


class _FakeDriver:
    """Plays the NVIDIA driver's start (``GpuDriver.start``, between the two steps of the
    confinement): it binds and listens on a Unix socket, as ``cuInit`` does, and leaves a
    thread running, as ``cuInit`` does. After the lock, that thread tries what a hijacked
    driver thread would: a Unix socket, the owner's bus, the worker's key."""

    def __init__(self, results: dict[str, str], targets: dict) -> None:  # type: ignore[type-arg]
        import threading

        from desktop_worker.sandbox import gpu_driver
        from desktop_worker.sandbox.gpu_driver import DriverStart

        self.results, self.targets = results, targets
        self.go, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._later)

        def start(_self: object) -> DriverStart:
            def listen() -> None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.bind("\0apiary-fake-driver")
                sock.listen()
                self.kept = sock  # the driver keeps its socket

            results["driver_bind_listen"] = attempt(listen)
            self.thread.start()
            return DriverStart("fake libcuda", 0)

        gpu_driver.GpuDriver.start = start  # type: ignore[method-assign]

    def _later(self) -> None:
        self.go.wait(30)

        def dial_unix() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(self.targets["unix"])

        def read_key() -> None:
            with open(self.targets["key"], "rb") as handle:
                handle.read(16)

        self.results["driver_thread_unix_socket"] = attempt(
            lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
        self.results["driver_thread_dial_unix"] = attempt(dial_unix)
        self.results["driver_thread_read_key"] = attempt(read_key)
        self.done.set()

    def after_lock(self) -> None:
        self.go.set()
        self.done.wait(30)


def _fork() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid


def _name_own_thread() -> None:
    """Name a thread the way glibc's pthread_setname_np does for another thread: write
    /proc/self/task/<tid>/comm."""
    import threading

    named = threading.Event()
    stop = threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        named.set()
        stop.wait(5)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        named.wait(5)
        with open(f"/proc/self/task/{tid[0]}/comm", "w") as handle:
            handle.write("cuda-EvtHandlr")
        with open(f"/proc/self/task/{tid[0]}/comm") as handle:
            if handle.read().strip() != "cuda-EvtHandlr":
                raise RuntimeError("the name did not take")
    finally:
        stop.set()
        worker.join(5)


def _thread() -> None:
    import threading

    done = threading.Event()
    worker = threading.Thread(target=done.set)
    worker.start()
    worker.join(5)
    if not done.is_set():
        raise RuntimeError("the thread did not run")


if __name__ == "__main__":
    main()
