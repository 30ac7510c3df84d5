"""Give benchmark processes a CPU of their own on a machine that has too few: a cgroup CPU quota
each (``cfs_quota_us`` on cgroup v1, ``cpu.max`` on v2), so that two queens on one 2-core VM
each get, say, half a core and neither can take the other's time. Linux only, and it needs
write access to the cgroup file system (root, or a delegated subtree); ``CpuQuotas.open``
says exactly why when it cannot.

    with CpuQuotas.open("replica-hop") as quotas:
        quotas.limit("A", pid_a, cpus=0.5)
        before = quotas.stats()
        ...
        throttled = quotas.throttled_since(before)  # share of periods each group hit its cap

The groups are removed on exit (their processes go back to the root group first).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 100_000
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class QuotaUnavailable(RuntimeError):
    """This machine will not let the bench set CPU quotas (and why)."""


@dataclass(frozen=True)
class Throttle:
    periods: int  # scheduler periods in which the group ran
    throttled: int  # of which it used its whole quota and was held back

    def since(self, before: Throttle) -> float:
        periods = self.periods - before.periods
        return (self.throttled - before.throttled) / periods if periods > 0 else 0.0


class CpuQuotas:
    """A set of cgroups made for one bench run, one per named process."""

    def __init__(self, root: Path, v2: bool, prefix: str) -> None:
        self.root = root
        self.v2 = v2
        self.prefix = prefix
        self.groups: dict[str, Path] = {}

    @classmethod
    def open(cls, prefix: str) -> CpuQuotas:
        v2_controllers = V2_ROOT / "cgroup.controllers"
        if V1_ROOT.is_dir() and os.access(V1_ROOT, os.W_OK):
            return cls(V1_ROOT, False, f"{prefix}-{os.getpid()}")
        if v2_controllers.is_file() and "cpu" in v2_controllers.read_text().split() \
                and os.access(V2_ROOT, os.W_OK):
            return cls(V2_ROOT, True, f"{prefix}-{os.getpid()}")
        raise QuotaUnavailable(
            "no writable cgroup CPU controller (tried /sys/fs/cgroup/cpu for cgroup v1 and "
            "/sys/fs/cgroup with 'cpu' in cgroup.controllers for v2): run as root, or without "
            "the CPU quota option")

    def limit(self, name: str, pid: int, cpus: float) -> None:
        """Move ``pid`` (all its threads) into a group of its own capped at ``cpus`` cores."""
        if cpus <= 0:
            raise ValueError("a CPU quota must be positive")
        group = self.root / f"{self.prefix}-{name}"
        group.mkdir(exist_ok=True)
        quota_us = int(cpus * PERIOD_US)
        if self.v2:
            (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        (group / "cgroup.procs").write_text(str(pid))
        self.groups[name] = group

    def stats(self) -> dict[str, Throttle]:
        out = {}
        for name, group in self.groups.items():
            fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines()
                          if line.count(" ") == 1)
            out[name] = Throttle(int(fields.get("nr_periods", 0)),
                                 int(fields.get("nr_throttled", 0)))
        return out

    def throttled_since(self, before: dict[str, Throttle]) -> dict[str, float]:
        now = self.stats()
        return {name: now[name].since(before[name]) for name in now if name in before}

    def close(self) -> None:
        for group in self.groups.values():
            with contextlib.suppress(OSError):  # a process that is gone needs no moving
                for pid in (group / "cgroup.procs").read_text().split():
                    (self.root / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
        self.groups.clear()

    def __enter__(self) -> CpuQuotas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
