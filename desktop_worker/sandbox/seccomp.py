"""A seccomp-bpf system call filter for engine children on Linux, written with ctypes.

``program(arch, sockets)`` builds the filter as bytes (pure, tested on its own); ``install``
loads it into the calling process (``no_new_privs`` must be set first). What it refuses, with
``EPERM`` unless noted:

- running programs: ``execve``, ``execveat``; new processes: ``fork``, ``vfork``, and ``clone``
  without ``CLONE_THREAD`` (threads are allowed); ``clone3`` answers ``ENOSYS``, so glibc falls
  back to ``clone``, whose flags the filter can read;
- reaching into other processes or the kernel: ``ptrace``, ``process_vm_readv/writev``,
  ``pidfd_getfd``, ``kcmp``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``,
  kernel modules, ``kexec``, ``keyctl``/``add_key``/``request_key``, ``syslog``, ``acct``,
  ``reboot``, swap, clocks, host names, ``iopl``/``ioperm``, ``personality``;
- changing the sandbox or the file system's shape: ``mount`` and the new mount API,
  ``umount2``, ``pivot_root``, ``chroot``, ``unshare``, ``setns``, ``open_by_handle_at``,
  ``name_to_handle_at``, ``setrlimit`` and ``prlimit64`` with a new limit (reading one is
  fine), ``capset``, ``set*uid``/``set*gid``/``setgroups``;
- memory its data limit (``RLIMIT_DATA``) does not count: System V shared memory (``shmget``,
  ``shmat``, ``shmctl``) always, and where the child has no GPU device to share memory with,
  ``memfd_create`` and ``mmap`` of shared anonymous memory (``shared_memory=False``);
- sockets: none at all (``socket``, ``socketpair``, ``connect``, ``bind``, ``listen``,
  ``accept``), unless the role needs TCP: a group head may create IPv4/IPv6 stream sockets and
  ``connect`` (Landlock then limits the ports), a member's RPC server may create them, ``bind``,
  ``listen`` and ``accept`` (never ``connect``). Never a Unix socket that reaches another
  process: no D-Bus, no keyring daemon, no X server.

A GPU driver's start: the NVIDIA driver's ``cuInit`` makes an ``AF_UNIX`` socket, ``bind``s it
and ``listen``s (error 304 when refused: driver 580, an H200, issue 41), and needs none of that
afterwards. So a child that runs a GPU driver is confined in two steps: first with
``unix_sockets`` (``AF_UNIX`` sockets, ``bind`` and ``listen``, but no ``accept``, and no
``connect`` unless its role dials), then, once the driver has started and before the child reads
any model or peer byte, ``driver_lock`` is stacked on top for every thread (``install(...,
all_threads=True)``, ``SECCOMP_FILTER_FLAG_TSYNC``): no ``AF_UNIX`` socket, no socket pair, and
``bind``/``listen`` only for a role that listens. The driver's own listening socket stays: it can
dial no one, and without ``accept`` nothing can reach the child through it.

The architecture is checked first: a system call from another ABI (i386 or x32 on x86_64,
32-bit ARM on aarch64) kills the process. A denylist rather than an allowlist, because
llama.cpp's GPU runtimes (CUDA, Vulkan) make system calls that change between driver versions;
the filesystem, network and signals are Landlock's part (``landlock.py``).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from dataclasses import dataclass

from desktop_worker.errors import SandboxError

# linux/filter.h and linux/seccomp.h
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
_NR, _ARCH = 0, 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index  # little-endian: the low 32 bits come first


def _arg_high(index: int) -> int:
    return 16 + 8 * index + 4


CLONE_THREAD = 0x00010000
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM = 1
SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK and SOCK_CLOEXEC
X32_SYSCALL_BIT = 0x40000000
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_SET_MODE_FILTER = 1  # the seccomp(2) system call's operation
SECCOMP_FILTER_FLAG_TSYNC = 1
SECCOMP_SYSCALL = {"x86_64": 317, "aarch64": 277}


@dataclass(frozen=True, slots=True)
class Arch:
    name: str
    audit: int  # AUDIT_ARCH_*
    numbers: dict[str, int]
    x32: bool = False  # x86_64: system calls with the x32 bit are another ABI


_COMMON_GENERIC = {  # asm-generic/unistd.h (aarch64)
    "execve": 221, "execveat": 281, "clone": 220, "clone3": 435, "ptrace": 117,
    "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40, "umount2": 39,
    "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
    "userfaultfd": 282, "socket": 198, "socketpair": 199, "bind": 200, "listen": 201,
    "accept": 202, "connect": 203, "accept4": 242, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 265,
    "name_to_handle_at": 264, "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89,
    "quotactl": 60, "quotactl_fd": 443, "settimeofday": 170, "clock_settime": 112,
    "adjtimex": 171, "syslog": 116, "personality": 92, "move_mount": 429, "open_tree": 428,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "setrlimit": 164, "prlimit64": 261, "process_madvise": 440, "pidfd_getfd": 438,
    "kcmp": 272, "sethostname": 161, "setdomainname": 162, "vhangup": 58,
    "lookup_dcookie": 18, "capset": 91, "setuid": 146, "setgid": 144, "setreuid": 145,
    "setregid": 143, "setresuid": 147, "setresgid": 149, "setgroups": 159,
    "shmget": 194, "shmctl": 195, "shmat": 196, "memfd_create": 279, "mmap": 222,
}

X86_64 = Arch("x86_64", 0xC000003E, {
    "execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165,
    "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
    "delete_module": 176, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248,
    "request_key": 249, "userfaultfd": 323, "socket": 41, "socketpair": 53, "connect": 42,
    "bind": 49, "listen": 50, "accept": 43, "accept4": 288, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163,
    "quotactl": 179, "quotactl_fd": 443, "settimeofday": 164, "clock_settime": 227,
    "adjtimex": 159, "syslog": 103, "iopl": 172, "ioperm": 173, "personality": 135,
    "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "setrlimit": 160, "prlimit64": 302,
    "process_madvise": 440, "pidfd_getfd": 438, "kcmp": 312, "sethostname": 170,
    "setdomainname": 171, "vhangup": 153, "lookup_dcookie": 212, "capset": 126,
    "setuid": 105, "setgid": 106, "setreuid": 113, "setregid": 114, "setresuid": 117,
    "setresgid": 119, "setgroups": 116, "shmget": 29, "shmat": 30, "shmctl": 31,
    "memfd_create": 319, "mmap": 9,
}, x32=True)
AARCH64 = Arch("aarch64", 0xC00000B7, _COMMON_GENERIC)

ARCHES = {"x86_64": X86_64, "amd64": X86_64, "aarch64": AARCH64, "arm64": AARCH64}

# Refused outright in every role.
DENIED = (
    "execve", "execveat", "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf", "perf_event_open",
    "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "open_by_handle_at", "name_to_handle_at", "swapon", "swapoff",
    "reboot", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "adjtimex",
    "syslog", "iopl", "ioperm", "personality", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "setrlimit", "process_madvise", "pidfd_getfd", "kcmp",
    "sethostname", "setdomainname", "vhangup", "lookup_dcookie", "capset", "setuid", "setgid",
    "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "socketpair",
    "shmget", "shmat", "shmctl",
)


@dataclass(frozen=True, slots=True)
class Sockets:
    """Which socket calls a role may make: ``tcp`` creates IPv4/IPv6 stream sockets,
    ``connect`` dials (a head), ``listen`` binds, listens and accepts (a member)."""

    tcp: bool = False
    connect: bool = False
    listen: bool = False


NO_SOCKETS = Sockets()


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def _ret(value: int) -> bytes:
    return _insn(_RET_K, value)


def _errno(code: int) -> int:
    return RET_ERRNO | (code & 0xFFFF)


def _deny(number: int, value: int) -> list[bytes]:
    """``if nr == number: return value`` (the accumulator holds nr, before and after)."""
    return [_insn(_JEQ_K, number, 0, 1), _ret(value)]


def _when(number: int, body: list[bytes]) -> list[bytes]:
    """``if nr == number: body`` (body ends by returning); the accumulator holds nr after."""
    return [_insn(_JEQ_K, number, 0, len(body)), *body]


def program(arch: Arch, sockets: Sockets = NO_SOCKETS, *, shared_memory: bool = True,
            unix_sockets: bool = False) -> bytes:
    """The filter's instructions (``struct sock_filter`` each), ready for ``install``.
    ``shared_memory``: the child may make shared memory its data limit does not count
    (``memfd_create``, shared anonymous ``mmap``): a GPU runtime may need it.
    ``unix_sockets``: ``AF_UNIX`` sockets, ``bind`` and ``listen``, for a GPU driver's start
    only: ``driver_lock`` must follow before the child reads anything it was sent."""
    eperm = _errno(errno.EPERM)
    numbers = arch.numbers
    out = _arch_check(arch)
    for name in DENIED:
        if name in numbers:
            out += _deny(numbers[name], eperm)
    out += _deny(numbers["clone3"], _errno(errno.ENOSYS))
    # clone: threads only (its flags are the first argument on both architectures)
    out += _when(numbers["clone"], [
        _insn(_LD_W_ABS, _arg_low(0)),
        _insn(_JSET_K, CLONE_THREAD, 0, 1),
        _ret(RET_ALLOW),
        _ret(eperm),
    ])
    # prlimit64(pid, resource, new_limit, old_limit): reading only
    out += _when(numbers["prlimit64"], [
        _insn(_LD_W_ABS, _arg_low(2)),
        _insn(_JEQ_K, 0, 1, 0),
        _ret(eperm),
        _insn(_LD_W_ABS, _arg_high(2)),
        _insn(_JEQ_K, 0, 0, 1),
        _ret(RET_ALLOW),
        _ret(eperm),
    ])
    if not shared_memory:
        out += _deny(numbers["memfd_create"], eperm)
        # mmap(addr, length, prot, flags, fd, offset): shared and anonymous together, refused
        out += _when(numbers["mmap"], [
            _insn(_LD_W_ABS, _arg_low(3)),
            _insn(_AND_K, MAP_SHARED | MAP_ANONYMOUS),
            _insn(_JEQ_K, MAP_SHARED | MAP_ANONYMOUS, 0, 1),
            _ret(eperm),
            _ret(RET_ALLOW),
        ])
    out += _when(numbers["socket"], _socket_rule(sockets.tcp, unix_sockets, eperm))
    if not sockets.connect:
        out += _deny(numbers["connect"], eperm)
    if not sockets.listen:
        refused = ("accept", "accept4") if unix_sockets else ("bind", "listen", "accept",
                                                              "accept4")
        for name in refused:
            out += _deny(numbers[name], eperm)
    out.append(_ret(RET_ALLOW))
    return b"".join(out)


def driver_lock(arch: Arch, sockets: Sockets = NO_SOCKETS) -> bytes:
    """Stacked on ``program(..., unix_sockets=True)`` once the GPU driver has started: no
    ``AF_UNIX`` socket from then on, and ``bind``/``listen`` only for a role that listens."""
    eperm = _errno(errno.EPERM)
    numbers = arch.numbers
    out = _arch_check(arch)
    out += _when(numbers["socket"], [
        _insn(_LD_W_ABS, _arg_low(0)),
        _insn(_JEQ_K, AF_UNIX, 0, 1),
        _ret(eperm),
        _ret(RET_ALLOW),
    ])
    if not sockets.listen:
        for name in ("bind", "listen"):
            out += _deny(numbers[name], eperm)
    out.append(_ret(RET_ALLOW))
    return b"".join(out)


def _arch_check(arch: Arch) -> list[bytes]:
    """Kill a system call from another ABI; leave the call's number in the accumulator."""
    out = [
        _insn(_LD_W_ABS, _ARCH),
        _insn(_JEQ_K, arch.audit, 1, 0),
        _ret(RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _NR),
    ]
    if arch.x32:
        out += [_insn(_JGE_K, X32_SYSCALL_BIT, 0, 1), _ret(RET_KILL_PROCESS)]
    return out


def _socket_rule(tcp: bool, unix: bool, eperm: int) -> list[bytes]:
    """socket(domain, type, protocol): ``AF_UNIX`` where ``unix``, IPv4/IPv6 streams where
    ``tcp``, nothing else."""
    body = [_insn(_LD_W_ABS, _arg_low(0))]
    if unix:
        body += [_insn(_JEQ_K, AF_UNIX, 0, 1), _ret(RET_ALLOW)]
    if tcp:
        body += [
            _insn(_JEQ_K, AF_INET, 1, 0),
            _insn(_JEQ_K, AF_INET6, 0, 4),
            _insn(_LD_W_ABS, _arg_low(1)),
            _insn(_AND_K, SOCK_TYPE_MASK),
            _insn(_JEQ_K, SOCK_STREAM, 0, 1),
            _ret(RET_ALLOW),
        ]
    return [*body, _ret(eperm)]


def current_arch() -> Arch | None:
    return ARCHES.get(platform.machine().lower())


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(code: bytes, *, all_threads: bool = False) -> None:
    """Load the filter into this thread (``PR_SET_SECCOMP``); threads started later inherit
    it. ``all_threads``: into every thread of the process (``seccomp(2)`` with
    ``SECCOMP_FILTER_FLAG_TSYNC``), for a filter stacked after a GPU driver started its own.
    ``no_new_privs`` must be set already."""
    count = len(code) // 8
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(count, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if all_threads:
        number = SECCOMP_SYSCALL.get(platform.machine().lower())
        if number is None:
            raise SandboxError(f"no seccomp(2) number known for {platform.machine()}")
        libc.syscall.argtypes = [ctypes.c_long, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_void_p]
        result = libc.syscall(number, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC,
                              ctypes.byref(prog))
    else:
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                               ctypes.c_ulong]
        result = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)
    if result != 0:
        err = ctypes.get_errno()
        detail = errno.errorcode.get(err, err) if result < 0 else f"thread {result} differs"
        raise SandboxError(f"the system call filter could not be installed: {detail}")
