"""Does the CUDA driver start inside the engine's sandbox? On a machine with an NVIDIA GPU:
one child per variant, confined exactly as an engine child that loads a model on the GPU
(``policy_for("context")`` with this machine's GPU device files, the child's environment:
``confine`` starts the driver between the filter and its lock), then the CUDA driver API:
``cuInit``, a context, 256 MB on the device, 64 MB pinned on the host. Variants: the policy as
shipped; without what only a GPU driver is allowed (``gpu_driver``), without the driver's start
before the lock, and each allowance left out alone (a Unix socket that binds and listens while
the driver starts, its own threads' names in /proc/self/task, shared memory); more than shipped
(writing /tmp or /dev/shm, reading everything); every refusal logged instead (the kernel's log
names the calls); no Landlock; no system call filter.

Seen on an H200 (driver 580, issue 41): before the driver's start moved inside ``confine``,
``cuInit`` failed with 304 until ``bind`` and ``listen`` were allowed (the kernel's log named
``connect``, ``bind`` and ``listen`` of an ``AF_UNIX`` socket); with the driver started first,
a context, device memory and pinned memory needed no Unix socket and no thread names, but
shared memory.

    python bench/gpu_sandbox_probe.py            # prints one line per variant, then a table

Error 304 (CUDA_ERROR_OPERATING_SYSTEM) is what the driver says when the sandbox refused it
something. Run by bench/gpu_steps.sh on the GPU check; see bench/RESULTS.md, "GPU check".
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "as shipped": {},
    "no gpu_driver allowances": {"gpu_driver": False},
    "without the driver's start": {"no_start": True},
    "without Unix sockets at the start": {"unix_sockets": False},
    "without own thread names": {"own_tasks": False},
    "without shared memory": {"shared_memory": False},
    # where "as shipped" fails: what more it needs
    "+ write /tmp": {"write": ["/tmp"]},
    "+ write /dev/shm": {"write": ["/dev/shm"]},
    "+ read everything": {"read_all": True},
    # every refusal of the filter becomes "allow, and log it" (SECCOMP_RET_LOG): the kernel's
    # log then names the calls the filter would have refused
    "log instead of refusing": {"log": True},
    "no Landlock": {"landlock": False},
    "no system call filter": {"seccomp": False},
}
DRIVER_PATHS = ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1")


def child(variant: str) -> None:
    from desktop_worker.sandbox import confine as confine_module
    from desktop_worker.sandbox import gpu_driver, landlock, seccomp
    from desktop_worker.sandbox.policy import policy_for

    change = VARIANTS[variant]
    policy = policy_for("context", scratch=os.environ["APIARY_PROBE_SCRATCH"], memory_mb=2048)
    if "gpu_driver" in change:
        policy = policy.model_copy(update={"gpu_driver": change["gpu_driver"]})
    if change.get("read_all"):
        policy = policy.model_copy(update={"read_paths": ["/", *policy.read_paths]})
    if change.get("write"):
        extra = list(change["write"])
        add_path = landlock._add_path

        def add_with_extra(libc, ruleset, path, rights, skipped, keep_open=False):  # type: ignore[no-untyped-def]
            fd = add_path(libc, ruleset, path, rights, skipped, keep_open)
            if path == policy.scratch:  # the same rights as the scratch folder
                for more in extra:
                    add_path(libc, ruleset, more, rights, skipped)
            return fd

        landlock._add_path = add_with_extra  # type: ignore[assignment]
    if change.get("no_start"):
        gpu_driver.GpuDriver.start = (  # type: ignore[method-assign]
            lambda self: gpu_driver.DriverStart(None))
    if change.get("log"):
        seccomp._errno = lambda code: 0x7FFC0000  # SECCOMP_RET_LOG
    if change.get("landlock") is False:
        confine_module.landlock.abi_version = lambda: 0  # type: ignore[attr-defined]
    if change.get("seccomp") is False:
        confine_module.seccomp.current_arch = lambda: None  # type: ignore[attr-defined]
    if change.get("own_tasks") is False:
        restrict = landlock.restrict
        confine_module.landlock.restrict = (  # type: ignore[attr-defined]
            lambda rules, abi=None: restrict(dataclasses.replace(rules, own_tasks=False), abi))
    flags = {k: v for k, v in change.items() if k in ("unix_sockets", "shared_memory")}
    if flags:
        program = seccomp.program
        confine_module.seccomp.program = (  # type: ignore[attr-defined]
            lambda arch, sockets=seccomp.NO_SOCKETS, **kw: program(arch, sockets,
                                                                   **{**kw, **flags}))
    confinement = confine_module.confine(policy, "context")
    result: dict[str, object] = {"variant": variant, "devices": len(policy.device_paths),
                                 "landlock_abi": confinement.landlock_abi if
                                 confinement.filesystem else 0,
                                 "seccomp": confinement.seccomp}
    cuda = None
    for path in DRIVER_PATHS:
        try:
            cuda = ctypes.CDLL(path)
            break
        except OSError:
            continue
    if cuda is None:
        result["error"] = "no libcuda.so.1"
    else:
        result["cuInit"] = cuda.cuInit(0)
        if result["cuInit"] == 0:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            pointer, host = ctypes.c_uint64(), ctypes.c_void_p()
            result["cuDeviceGet"] = cuda.cuDeviceGet(ctypes.byref(device), 0)
            result["cuCtxCreate"] = cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device)
            result["cuMemAlloc"] = cuda.cuMemAlloc_v2(ctypes.byref(pointer), 256 << 20)
            result["cuMemHostAlloc"] = cuda.cuMemHostAlloc(ctypes.byref(host), 64 << 20, 0)
    print("PROBE " + json.dumps(result), flush=True)


def main(only: list[str] | None = None) -> int:
    from desktop_worker.sandbox.process import child_environment

    rows = []
    for variant in only or VARIANTS:
        scratch = tempfile.mkdtemp(prefix="apiary-probe-")
        env = child_environment(scratch)
        env["APIARY_PROBE_SCRATCH"] = scratch
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
        done = subprocess.run([sys.executable, __file__, variant], capture_output=True,
                              text=True, timeout=60, cwd=scratch, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
        row = json.loads(lines[-1][6:]) if lines else {
            "variant": variant, "error": f"exit {done.returncode}: {done.stderr[-300:]!r}"}
        print("PROBE " + json.dumps(row), flush=True)
        rows.append(row)
    print(f"{'variant':<34} {'Landlock':>8} {'seccomp':>8} {'cuInit':>7} {'context':>8} "
          f"{'alloc':>6} {'pinned':>7}")
    for row in rows:
        print(f"{row['variant']:<34} {row.get('landlock_abi', '-')!s:>8} "
              f"{row.get('seccomp', '-')!s:>8} {row.get('cuInit', '-')!s:>7} "
              f"{row.get('cuCtxCreate', '-')!s:>8} {row.get('cuMemAlloc', '-')!s:>6} "
              f"{row.get('cuMemHostAlloc', '-')!s:>7} {row.get('error', '')}")
    if "log instead of refusing" in (only or VARIANTS):
        log = subprocess.run(["dmesg"], capture_output=True, text=True)
        lines = [line for line in log.stdout.splitlines() if "seccomp" in line.lower()
                 or "type=1326" in line]
        print(f"kernel log, seccomp lines ({len(lines)}; dmesg rc {log.returncode}"
              f"{': ' + log.stderr.strip()[:200] if log.returncode else ''}):")
        for line in lines[-40:]:
            print("  " + line)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--only":
        sys.exit(main(sys.argv[2].split(",")))
    if len(sys.argv) > 1:
        child(sys.argv[1])
        sys.exit(0)
    sys.exit(main())
