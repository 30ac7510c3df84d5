"""An engine child confines itself: ``confine(policy, role)`` applies what this OS offers and
says what holds (``shared_schema.engine_ipc.Confinement``).

Linux, in this order, while the child still has one thread and has read nothing but the
worker's start message: die with the worker (``PR_SET_PDEATHSIG``), not dumpable, rlimits (no
core files, few open files, files at most ``max_file_mb``, data memory at most what it uses now
plus ``memory_mb``), every capability dropped (a worker run as root), ``no_new_privs``, Landlock
(``landlock.py``) and the system call filter (``seccomp.py``). Each step that fails is written
in ``notes``, and the worker decides what to do with a partial sandbox (no model groups). A
child that runs a GPU driver then starts the driver (``gpu_driver.py``) and stacks the filter's
lock on every thread (``seccomp.driver_lock``); if the lock cannot be installed the child stops
(``SandboxError``) rather than run on with the driver's allowances.

Other systems: nothing is applied here yet (``notes`` says so); the child still runs in its own
process, so a crash in llama.cpp ends only the child.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

from desktop_worker.errors import SandboxError
from desktop_worker.sandbox import landlock, seccomp
from desktop_worker.sandbox.gpu_driver import GpuDriver
from shared_schema.engine_ipc import Confinement, Role, SandboxPolicy

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 1, 4, 38, 24
PR_GET_NO_NEW_PRIVS = 39
CAP_LAST_CAP_GUESS = 63
MB = 1024 * 1024


def sockets_for(role: Role, policy: SandboxPolicy) -> seccomp.Sockets:
    """The socket calls a role may make: a head dials its dialers, a member's server listens;
    a context and a probe make none."""
    if role == "head" and policy.connect_ports:
        return seccomp.Sockets(tcp=True, connect=True)
    if role == "member" and policy.bind_ports:
        return seccomp.Sockets(tcp=True, listen=True)
    return seccomp.NO_SOCKETS


def confine(policy: SandboxPolicy, role: Role) -> Confinement:
    if sys.platform.startswith("linux"):
        return _confine_linux(policy, role)
    return Confinement(os=sys.platform, notes=[
        f"no sandbox is applied on {sys.platform} yet: the engine runs in its own process as "
        "your user, so a crash in it ends only that process, but it could read your files"])


def _prctl(libc: ctypes.CDLL, option: int, value: int) -> bool:
    return libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) == 0


def data_in_use_mb() -> int:
    """This process's data memory now (``VmData``), MB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _confine_linux(policy: SandboxPolicy, role: Role) -> Confinement:
    import resource  # POSIX only: this module is imported on every system
    import signal

    notes: list[str] = []
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(libc, PR_SET_DUMPABLE, 0)
    if threading.active_count() != 1 or _os_threads() > 1:
        notes.append("the engine had more than one thread when it confined itself")
    # rlimits, while they can still be set
    limit_mb = None
    rlimits = True
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (policy.max_open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (policy.max_file_mb * MB,) * 2)
        if policy.memory_mb is not None:
            limit_mb = data_in_use_mb() + policy.memory_mb
            resource.setrlimit(resource.RLIMIT_DATA, (limit_mb * MB,) * 2)
    except (OSError, ValueError) as exc:
        rlimits = False
        notes.append(f"resource limits could not be set: {exc}")
    caps = _drop_capabilities(libc)
    if not caps:
        notes.append("capabilities could not be dropped")
    no_new_privs = _prctl(libc, PR_SET_NO_NEW_PRIVS, 1)
    if not no_new_privs:
        notes.append("no_new_privs could not be set")
    filesystem = network = signals = False
    abi = landlock.abi_version()
    if abi <= 0:
        notes.append("this kernel has no Landlock (Linux 5.13+): the engine can read your files")
    else:
        rules = landlock.Rules(read=tuple(policy.read_paths), devices=tuple(policy.device_paths),
                               scratch=policy.scratch, bind_ports=tuple(policy.bind_ports),
                               connect_ports=tuple(policy.connect_ports),
                               own_tasks=policy.gpu_driver)
        try:
            enforced = landlock.restrict(rules, abi)
            filesystem, network, signals = True, enforced.network, enforced.scoped
            if not network:
                notes.append(f"Landlock ABI {abi} cannot limit TCP ports (Linux 6.7+ can)")
            if not signals:
                notes.append(f"Landlock ABI {abi} cannot stop signals to other processes "
                             "(Linux 6.12+ can)")
        except SandboxError as exc:
            notes.append(str(exc))
    sockets = sockets_for(role, policy)
    if policy.memory_mb is not None and policy.gpu_driver:
        notes.append("with a GPU to share memory with, the engine's memory limit does not count "
                     "shared memory")
    filtered = False
    arch = seccomp.current_arch()
    if arch is None:
        notes.append(f"no system call filter for this processor ({os.uname().machine})")
    elif no_new_privs:
        try:
            seccomp.install(seccomp.program(arch, sockets, shared_memory=policy.gpu_driver,
                                            unix_sockets=policy.gpu_driver))
            filtered = True
        except SandboxError as exc:
            notes.append(str(exc))
    if policy.gpu_driver:
        start = GpuDriver().start()
        if start.library is not None and not start.started:
            notes.append(start.describe())
        if filtered and arch is not None:  # the driver's allowances end with its start
            seccomp.install(seccomp.driver_lock(arch, sockets), all_threads=True)
    return Confinement(os="linux", no_new_privs=no_new_privs, seccomp=filtered,
                       landlock_abi=abi, filesystem=filesystem, tcp_ports=network,
                       # no socket at all (the filter), or only the policy's ports (Landlock)
                       network=filtered and (sockets == seccomp.NO_SOCKETS or network),
                       signals=signals, memory_limit_mb=limit_mb, rlimits=rlimits,
                       capabilities_dropped=caps, notes=notes)


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _drop_capabilities(libc: ctypes.CDLL) -> bool:
    """Drop every capability (effective, permitted, inheritable, and the bounding set): a
    no-op for a normal user, the rights of root for a worker run as root."""
    if os.geteuid() != 0:
        return True
    for cap in range(CAP_LAST_CAP_GUESS + 1):
        _prctl(libc, PR_CAPBSET_DROP, cap)  # fails past the kernel's last capability: fine
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    return libc.capset(ctypes.byref(header), data) == 0

