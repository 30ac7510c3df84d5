"""Landlock through ctypes (Linux 5.13+): what an engine child may read, write and dial.

``abi_version()`` asks the kernel which Landlock it has (0: none, or disabled). ``restrict``
builds a ruleset that handles every access right that version knows, adds the policy's rules
and enforces it on the calling thread, which every thread it starts later inherits (the child
confines itself while it has one thread). Anything not named by a rule is refused:

- read (files and folders, and running the libraries mapped from them): the policy's
  ``read_paths`` (Python, its packages, the system's libraries, the model's files);
- read, write and ioctl: the GPU device files (``device_paths``) and ``/dev/null``;
- everything: the ``scratch`` folder;
- read and write: the child's own threads' files (``/proc/self/task``, ``own_tasks``): a GPU
  driver names the threads it starts by writing ``/proc/self/task/<tid>/comm`` (the NVIDIA
  driver's ``cuInit`` fails with error 304 when it cannot, driver 570 and later). The rule
  binds to the inode of this process's ``task`` folder, so the folder is kept open for the
  child's lifetime (procfs could otherwise drop it and make another);
- TCP (ABI 4+): bind only ``bind_ports``, connect only ``connect_ports``;
- scoping (ABI 6+): no signals to, and no abstract Unix sockets of, processes outside the
  sandbox.

Landlock also keeps a sandboxed process from ptrace-ing (and so from reading the memory,
environment or files of) any process outside its domain, whatever the user ids.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from dataclasses import dataclass

from desktop_worker.errors import SandboxError

log = logging.getLogger(__name__)

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # all architectures
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH, RULE_NET_PORT = 1, 2

EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

_FS_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # what a file rule takes
READ = EXECUTE | READ_FILE | READ_DIR
O_PATH = getattr(os, "O_PATH", 0o10000000)


def fs_rights(abi: int) -> int:
    """Every filesystem right the kernel's Landlock ``abi`` handles."""
    rights = _FS_V1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when it has none or it is disabled."""
    if not sys.platform.startswith("linux"):
        return 0
    result = _libc().syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                             ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(0, int(result))


@dataclass(frozen=True, slots=True)
class Rules:
    read: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    scratch: str | None = None
    bind_ports: tuple[int, ...] = ()
    connect_ports: tuple[int, ...] = ()
    own_tasks: bool = False


@dataclass(frozen=True, slots=True)
class Enforced:
    abi: int
    filesystem: bool
    network: bool
    scoped: bool
    skipped: tuple[str, ...]  # paths named by the policy that do not exist here
    pinned: tuple[int, ...] = ()  # descriptors kept open: the inodes their rules bind to


def restrict(rules: Rules, abi: int | None = None) -> Enforced:
    """Enforce ``rules`` on this thread (and the threads it starts later)."""
    abi = abi_version() if abi is None else abi
    if abi <= 0:
        raise SandboxError("this kernel has no Landlock (Linux 5.13+ with landlock in its LSM "
                           "list)")
    libc = _libc()
    handled_fs = fs_rights(abi)
    network = abi >= 4
    scoped = abi >= 6
    attr = _RulesetAttr(handled_fs, NET_BIND_TCP | NET_CONNECT_TCP if network else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if scoped else 0)
    size = ctypes.sizeof(_RulesetAttr) if scoped else (16 if network else 8)
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise SandboxError(f"Landlock refused the ruleset: {_err()}")
    skipped: list[str] = []
    pinned: list[int | None] = []
    try:
        for path in rules.read:
            _add_path(libc, ruleset, path, READ & handled_fs, skipped)
        device_rights = (READ_FILE | WRITE_FILE | IOCTL_DEV) & handled_fs
        for path in (*rules.devices, "/dev/null"):
            _add_path(libc, ruleset, path, device_rights, skipped)
        if rules.scratch:
            _add_path(libc, ruleset, rules.scratch, handled_fs, skipped)
        if rules.own_tasks:
            task_rights = (READ_FILE | WRITE_FILE | TRUNCATE) & handled_fs
            pinned.append(_add_path(libc, ruleset, "/proc/self/task", task_rights, skipped,
                                    keep_open=True))
        if network:
            for port in rules.bind_ports:
                _add_port(libc, ruleset, port, NET_BIND_TCP)
            for port in rules.connect_ports:
                _add_port(libc, ruleset, port, NET_CONNECT_TCP)
        if libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise SandboxError(f"Landlock could not be enforced: {_err()}")
    finally:
        os.close(ruleset)
    return Enforced(abi, True, network, scoped, tuple(skipped),
                    tuple(fd for fd in pinned if fd is not None))


def _err() -> str:
    code = ctypes.get_errno()
    return errno.errorcode.get(code, str(code))


def _add_path(libc: ctypes.CDLL, ruleset: int, path: str, rights: int,
              skipped: list[str], keep_open: bool = False) -> int | None:
    """Add a rule for ``path``; with ``keep_open``, its descriptor is returned open."""
    try:
        fd = os.open(path, O_PATH | os.O_CLOEXEC)
    except OSError:
        skipped.append(path)
        return None
    try:
        if not os.path.isdir(path):
            rights &= FILE_RIGHTS  # a rule on a file takes only the rights a file has
        rule = _PathBeneath(rights, fd)
        if libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise SandboxError(f"Landlock refused the rule for {path}: {_err()}")
    except BaseException:
        os.close(fd)
        raise
    if keep_open:
        return fd
    os.close(fd)
    return None


def _add_port(libc: ctypes.CDLL, ruleset: int, port: int, right: int) -> None:
    rule = _NetPort(right, port)
    if libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_NET_PORT),
                    ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
        raise SandboxError(f"Landlock refused the rule for port {port}: {_err()}")

