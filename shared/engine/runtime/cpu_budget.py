"""How many threads a node's math may use: the CPUs this process may run on, never the machine's.

A container's cpuset, `taskset` and a cgroup CPU quota all leave `os.cpu_count()` at the
machine's count, and torch sizes its pool once, at import, from the affinity it had then (a
quota it never reads). More OpenMP threads than the CPUs behind them time-slice one core: every
parallel region waits for its last thread, which waits for the scheduler (SmolLM2 fp32, prefill
and decode nodes moved onto one core each after start, a 16-token prompt's first token: 1.4 s
with torch's two threads, 0.14 s with one; docs/performance.md). So a node runs as many threads
as the smallest of:

- the physical cores among the CPUs of its affinity mask (SMT siblings of one core count once,
  as in torch's own default);
- its cgroup's CPU quota, rounded down (cgroup v2 `cpu.max`; v1 `cpu.cfs_quota_us` over
  `cpu.cfs_period_us`; the tightest of the cgroup and its ancestors): a team wider than the
  quota spends it early in each period and then every thread waits for the next one;

divided by the nodes that share those CPUs (`PDSERVE_CPU_SHARED_BY`, which `pdserve up` sets),
and never below 1. A positive `OMP_NUM_THREADS` wins over all of it.

Everything here reads files and takes the paths as parameters (tests point them at their own);
nothing imports torch, so that `pdserve/cli/main.py` can use it before the OpenMP runtime loads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SHARED_BY_ENV = "PDSERVE_CPU_SHARED_BY"
PROC_SELF = Path("/proc/self")
SYSFS_CPUS = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CpuBudget:
    threads: int
    cpus: frozenset[int]  # the affinity mask
    cores: int  # physical cores among `cpus`
    machine_cpus: int
    quota: float | None  # CPUs the cgroup quota allows; None: no quota
    shared_by: int = 1
    override: str | None = None  # "OMP_NUM_THREADS=4" when that decides

    def describe(self, previous: int | None = None) -> str:
        """e.g. 'threads: 1 (affinity 1 of 2 CPUs; cgroup quota none)'; with `previous`, the
        count it replaces: 'threads: 2 -> 1 (...)'."""
        cores = "" if self.cores == len(self.cpus) else f", {self.cores} cores"
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        why = f"affinity {len(self.cpus)} of {self.machine_cpus} CPUs{cores}; cgroup quota {quota}"
        if self.shared_by > 1:
            why += f"; shared by {self.shared_by} nodes"
        if self.override:
            why = f"{self.override}; {why}"
        count = f"{previous} -> {self.threads}" if previous is not None else f"{self.threads}"
        return f"threads: {count} ({why})"


def explicit_threads(environ: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS's first level ("4" or "4,2"), or None where it is unset or not a positive
    count (OpenMP ignores such a value too)."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def _shared_by(environ: Mapping[str, str]) -> int:
    value = environ.get(SHARED_BY_ENV, "").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SHARED_BY_ENV}={value!r}: the number of nodes sharing these CPUs, >= 1")
    return int(value)


def _cpu_list(text: str) -> frozenset[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


class CpuBudgetReader:
    """Reads the budget; what cannot change while a process runs (which cgroup it is in, which
    CPUs are SMT siblings) is found once, so that a re-read costs a syscall and a file or two."""

    def __init__(self, proc: Path = PROC_SELF, sysfs: Path = SYSFS_CPUS):
        self._sysfs = sysfs
        self._quota_dirs = cgroup_cpu_dirs(proc)
        self._core_of: dict[int, frozenset[int]] = {}

    def read(self, cpus: frozenset[int], environ: Mapping[str, str]) -> CpuBudget:
        cores = len({self._core(cpu) for cpu in cpus})
        quota = cpu_quota(self._quota_dirs)
        shared_by = _shared_by(environ)
        usable = min(cores, math.floor(quota)) if quota is not None else cores
        threads = max(1, usable // shared_by)
        override = None
        explicit = explicit_threads(environ)
        if explicit is not None:
            threads, override = explicit, f"OMP_NUM_THREADS={explicit}"
        machine = os.cpu_count() or len(cpus)
        return CpuBudget(threads, cpus, cores, machine, quota, shared_by, override)

    def _core(self, cpu: int) -> frozenset[int]:
        """The CPUs sharing `cpu`'s physical core (itself alone where sysfs does not say)."""
        if cpu not in self._core_of:
            topology = self._sysfs / f"cpu{cpu}" / "topology"
            siblings = frozenset({cpu})
            for name in ("core_cpus_list", "thread_siblings_list"):  # new name, older name
                try:
                    siblings = _cpu_list((topology / name).read_text()) or siblings
                    break
                except (OSError, ValueError):
                    continue
            self._core_of[cpu] = siblings
        return self._core_of[cpu]


def process_cpus() -> frozenset[int]:
    """The affinity of the process's main thread: what `taskset -p PID` and a cpuset set, and
    what any thread of the process may be moved to."""
    return frozenset(os.sched_getaffinity(os.getpid()))


def read_budget(environ: Mapping[str, str] = os.environ) -> CpuBudget:
    return CpuBudgetReader().read(process_cpus(), environ)


# --- cgroups -------------------------------------------------------------------------------


def _mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root, mount point, super options) of each cgroup mount in /proc/PID/mountinfo."""
    mounts = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if sep and len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            mounts.append((rest[0], fields[3], fields[4], set(rest[2].split(","))))
    return mounts


def cgroup_cpu_dirs(proc: Path = PROC_SELF) -> list[tuple[str, Path, Path]]:
    """(version "v1"/"v2", the process's cgroup directory, its mount point) for each hierarchy
    that can hold a CPU quota; empty where there are no cgroups (not Linux, no /proc)."""
    return cgroup_dirs("cpu", proc)


def cgroup_dirs(controller: str, proc: Path = PROC_SELF) -> list[tuple[str, Path, Path]]:
    """(version, the process's cgroup directory, its mount point) for each hierarchy that can
    hold `controller`'s limits ("cpu", "memory"): the unified (v2) one and a v1 one mounted
    with that controller."""
    try:
        memberships = (proc / "cgroup").read_text().splitlines()
        mounts = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return []
    found = []
    for line in memberships:
        parts = line.split(":", 2)  # hierarchy id : controllers : path
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2]
        for fstype, root, point, options in mounts:
            v2 = fstype == "cgroup2" and controllers == ""
            v1 = (
                fstype == "cgroup"
                and controller in options
                and controller in controllers.split(",")
            )
            if v2 or v1:
                # a cgroup namespace shows the mount's own root, not the path /proc names
                below = path == root or path.startswith(root.rstrip("/") + "/")
                inside = os.path.relpath(path, root) if below else "."
                found.append(("v2" if v2 else "v1", Path(point) / inside, Path(point)))
    return found


def _level_quota(version: str, directory: Path) -> float | None:
    """CPUs one cgroup directory's quota allows; None: unlimited or no such file."""
    try:
        if version == "v2":
            limit, period = (directory / "cpu.max").read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        limit = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if limit < 0 else limit / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cpu_quota(dirs: list[tuple[str, Path, Path]]) -> float | None:
    """The tightest quota over each cgroup and its ancestors up to the mount point, in CPUs."""
    quotas = []
    for version, directory, top in dirs:
        level = directory
        while True:
            quota = _level_quota(version, level)
            if quota is not None:
                quotas.append(quota)
            if level == top or level == level.parent or not level.is_relative_to(top):
                break
            level = level.parent
    return min(quotas, default=None)
