"""The CPU budget (shared/engine/runtime/cpu_budget.py) read from real files: fake
/proc/self/cgroup,
mountinfo, cgroup quota and sysfs topology files written under tmp_path; and the node's OpenMP
wait policy default (shared/engine/scheduling/wait_policy.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shared.engine.runtime.cpu_budget import (
    CpuBudgetReader,
    cgroup_cpu_dirs,
    cpu_quota,
    explicit_threads,
    process_cpus,
)
from shared.engine.scheduling.wait_policy import node_defaults

MOUNTINFO_V2 = "30 23 0:26 / {mnt} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTINFO_V1 = (
    "25 23 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
    "31 25 0:27 {root} {mnt} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "32 25 0:28 / /elsewhere rw,nosuid - cgroup cgroup rw,memory\n"
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    _write(proc / "cgroup", cgroup)
    _write(proc / "mountinfo", mountinfo)
    return proc


def _no_topology(tmp_path: Path) -> Path:
    return tmp_path / "no-sysfs"  # every CPU its own core


def test_v2_quota_is_the_tightest_over_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/kube/pod/ctr\n", MOUNTINFO_V2.format(mnt=mnt))
    _write(mnt / "kube" / "pod" / "ctr" / "cpu.max", "max 100000\n")
    _write(mnt / "kube" / "pod" / "cpu.max", "150000 100000\n")  # 1.5 CPUs for the pod
    _write(mnt / "kube" / "cpu.max", "800000 100000\n")
    assert cpu_quota(cgroup_cpu_dirs(proc)) == 1.5
    budget = CpuBudgetReader(proc, _no_topology(tmp_path)).read(frozenset(range(8)), {})
    assert budget.threads == 1 and budget.quota == 1.5  # rounded down: a wider team stalls


def test_v2_without_a_limit_leaves_the_affinity(tmp_path: Path) -> None:
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/svc\n", MOUNTINFO_V2.format(mnt=mnt))
    _write(mnt / "svc" / "cpu.max", "max 100000\n")
    budget = CpuBudgetReader(proc, _no_topology(tmp_path)).read(frozenset({2, 3, 5}), {})
    assert budget.quota is None and budget.threads == 3


def test_v1_quota_and_a_cgroup_namespace(tmp_path: Path) -> None:
    mnt = tmp_path / "cpu,cpuacct"
    # on the host: the path /proc names lies under the mount's root
    proc = _proc(
        tmp_path, "5:memory:/x\n3:cpu,cpuacct:/docker/abc\n", MOUNTINFO_V1.format(root="/", mnt=mnt)
    )
    _write(mnt / "docker" / "abc" / "cpu.cfs_quota_us", "250000\n")
    _write(mnt / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    _write(mnt / "cpu.cfs_quota_us", "-1\n")  # the root: unlimited
    _write(mnt / "cpu.cfs_period_us", "100000\n")
    assert cpu_quota(cgroup_cpu_dirs(proc)) == 2.5
    assert CpuBudgetReader(proc, _no_topology(tmp_path)).read(frozenset(range(4)), {}).threads == 2
    # in a container with its own cgroup namespace the mount's root is the container's cgroup,
    # whose files sit at the mount point itself
    inside = tmp_path / "inside"
    proc = _proc(inside, "3:cpu,cpuacct:/\n", MOUNTINFO_V1.format(root="/docker/abc", mnt=mnt))
    _write(mnt / "cpu.cfs_quota_us", "50000\n")
    assert cpu_quota(cgroup_cpu_dirs(proc)) == 0.5
    budget = CpuBudgetReader(proc, _no_topology(tmp_path)).read(frozenset(range(4)), {})
    assert budget.threads == 1  # never below one


def test_no_cgroups_and_unreadable_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_dirs(tmp_path / "missing") == []
    mnt = tmp_path / "cg2"
    proc = _proc(tmp_path, "0::/a\n", MOUNTINFO_V2.format(mnt=mnt))
    _write(mnt / "a" / "cpu.max", "garbage\n")
    assert cpu_quota(cgroup_cpu_dirs(proc)) is None


def test_smt_siblings_count_as_one_core(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    for cpu, siblings in {0: "0,4", 4: "0,4", 1: "1,5", 5: "1,5", 2: "2"}.items():
        _write(sysfs / f"cpu{cpu}" / "topology" / "core_cpus_list", siblings + "\n")
    _write(sysfs / "cpu3" / "topology" / "thread_siblings_list", "3,7\n")  # older kernels
    reader = CpuBudgetReader(tmp_path / "noproc", sysfs)
    budget = reader.read(frozenset({0, 4, 1, 5, 2, 3}), {})
    assert (budget.cores, budget.threads) == (4, 4)
    assert "affinity 6 of" in budget.describe() and "4 cores" in budget.describe()


def test_share_among_nodes_and_the_explicit_count(tmp_path: Path) -> None:
    reader = CpuBudgetReader(tmp_path / "noproc", _no_topology(tmp_path))
    cpus = frozenset(range(8))
    assert reader.read(cpus, {"PDSERVE_CPU_SHARED_BY": "3"}).threads == 2
    assert reader.read(cpus, {"PDSERVE_CPU_SHARED_BY": "20"}).threads == 1  # never zero
    explicit = reader.read(frozenset({0}), {"OMP_NUM_THREADS": "4,2"})
    assert explicit.threads == 4 and explicit.override == "OMP_NUM_THREADS=4"
    assert explicit.describe().startswith("threads: 4 (OMP_NUM_THREADS=4; affinity 1 of ")
    for ignored in ("", "0", "abc", "-2"):  # OpenMP ignores these too
        assert explicit_threads({"OMP_NUM_THREADS": ignored}) is None
    assert reader.read(cpus, {"PDSERVE_CPU_SHARED_BY": ""}).threads == 8  # compose's default
    with pytest.raises(ValueError, match="PDSERVE_CPU_SHARED_BY='two'"):
        reader.read(cpus, {"PDSERVE_CPU_SHARED_BY": "two"})


def test_describe_says_where_the_count_came_from(tmp_path: Path) -> None:
    budget = CpuBudgetReader(tmp_path / "noproc", _no_topology(tmp_path)).read(frozenset({0}), {})
    machine = os.cpu_count()
    assert budget.describe() == f"threads: 1 (affinity 1 of {machine} CPUs; cgroup quota none)"
    assert budget.describe(previous=2).startswith("threads: 2 -> 1 (")


def test_this_process_budget_never_exceeds_its_cpus() -> None:
    budget = CpuBudgetReader().read(process_cpus(), {})
    assert 1 <= budget.threads <= len(os.sched_getaffinity(0))
    assert re.fullmatch(
        r"threads: \d+ \(affinity \d+ of \d+ CPUs.*cgroup quota .+\)", budget.describe()
    )


def test_node_commands_default_to_the_passive_wait_policy() -> None:
    for command in ("prefill", "decode", "colocated"):
        assert node_defaults([command], {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert node_defaults(["decode"], {"OMP_WAIT_POLICY": "ACTIVE"}) == {}  # the operator's
    assert node_defaults(["decode"], {"GOMP_SPINCOUNT": "300000"}) == {}
    for other in (["up"], ["bench", "ttft"], []):
        assert node_defaults(other, {}) == {}  # `up` sets its nodes' own; benchmarks choose


@pytest.mark.parametrize("text,cpus", [("0-3,8\n", {0, 1, 2, 3, 8}), ("5", {5})])
def test_cpu_list_format(tmp_path: Path, text: str, cpus: set[int]) -> None:
    sysfs = tmp_path / "sys"
    for cpu in cpus:
        _write(sysfs / f"cpu{cpu}" / "topology" / "core_cpus_list", text)
    budget = CpuBudgetReader(tmp_path / "noproc", sysfs).read(frozenset(cpus), {})
    assert budget.cores == 1  # they all name the same sibling list
