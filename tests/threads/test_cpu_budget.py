"""The default thread count from fake /proc and /sys trees: cgroup v2 and v1, with and without a quota,
quotas on ancestors, container mounts, SMT siblings, missing and malformed files; explicit --threads wins."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from service.config import Settings
from service.cpu_budget import CpuBudget, read_cpu_budget
from service.engine.thread_governor import ThreadControl

V2_MOUNT = "31 23 0:28 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cgroup_v2(root: Path, cgroup: str, cpu_max: dict[str, str]) -> None:
    """A cgroup v2 hierarchy mounted at /sys/fs/cgroup with this process in ``cgroup`` and each ``cpu.max`` of
    ``cpu_max`` (cgroup path below the mount -> the file's line)."""
    write(root, "proc/self/cgroup", f"0::{cgroup}\n")
    write(root, "proc/self/mountinfo", V2_MOUNT)
    for rel, line in cpu_max.items():
        write(root, str(Path("sys/fs/cgroup", rel, "cpu.max")), line + "\n")


def cfs_quota(root: Path, folder: str, quota_us: int, period_us: int = 100000) -> None:
    """A cgroup v1 cpu controller's quota and period files in ``folder``."""
    write(root, f"{folder}/cpu.cfs_quota_us", f"{quota_us}\n")
    write(root, f"{folder}/cpu.cfs_period_us", f"{period_us}\n")


def topology(root: Path, cores: dict[int, str]) -> None:
    """cpu -> its core_cpus_list (the CPUs sharing its physical core)."""
    for cpu, siblings in cores.items():
        write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list", siblings + "\n")


def test_v2_quota_rounds_down_and_wins(tmp_path: Path) -> None:
    cgroup_v2(tmp_path, "/kubepods.slice/pod1/ctr", {"kubepods.slice/pod1/ctr": "250000 100000"})
    topology(tmp_path, {c: str(c) for c in range(8)})
    budget = read_cpu_budget(tmp_path, affinity=range(8))
    assert budget == CpuBudget(8, 8, 2.5, "cgroup v2 /sys/fs/cgroup/kubepods.slice/pod1/ctr/cpu.max")
    assert budget.threads == 2
    assert budget.source == "cgroup quota 2.5 CPUs (cgroup v2 /sys/fs/cgroup/kubepods.slice/pod1/ctr/cpu.max)"


def test_v2_without_quota_leaves_the_affinity(tmp_path: Path) -> None:
    cgroup_v2(tmp_path, "/ctr", {"ctr": "max 100000", "": "max 100000"})
    topology(tmp_path, {c: str(c) for c in range(16)})
    budget = read_cpu_budget(tmp_path, affinity={2, 3, 5})
    assert (budget.quota, budget.affinity, budget.physical_cores) == (None, 3, 3)
    assert (budget.threads, budget.source) == (3, "affinity")


def test_v2_an_ancestors_quota_counts_and_a_small_quota_still_gives_one_thread(tmp_path: Path) -> None:
    cgroup_v2(tmp_path, "/pod/ctr", {"pod/ctr": "max 100000", "pod": "50000 100000"})
    budget = read_cpu_budget(tmp_path, affinity=range(4))
    assert budget.quota == 0.5 and budget.quota_file == "cgroup v2 /sys/fs/cgroup/pod/cpu.max"
    assert budget.threads == 1


def test_v2_inside_a_cgroup_namespace(tmp_path: Path) -> None:
    """A container sees its own cgroup as "/" (cgroupns): the quota sits at the mount point itself."""
    cgroup_v2(tmp_path, "/", {"": "300000 100000"})
    assert read_cpu_budget(tmp_path, affinity=range(8)).threads == 3


def test_v2_cgroup_path_outside_the_mount_falls_back_to_the_mount_point(tmp_path: Path) -> None:
    """Without cgroupns a container may see the host's path while only its own subtree is mounted."""
    cgroup_v2(tmp_path, "/system.slice/docker-abc.scope", {"": "200000 100000"})
    assert read_cpu_budget(tmp_path, affinity=range(8)).threads == 2


def test_v1_quota_in_a_container_mount(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    write(
        tmp_path,
        "proc/self/mountinfo",
        "30 23 0:27 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "32 30 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        "33 30 0:30 /docker/abc /sys/fs/cgroup/memory ro,relatime - cgroup cgroup rw,memory\n",
    )
    cfs_quota(tmp_path, "sys/fs/cgroup/cpu,cpuacct", 300000)
    budget = read_cpu_budget(tmp_path, affinity=range(8))
    assert budget.quota == 3.0 and budget.quota_file == "cgroup v1 /sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"
    assert budget.threads == 3


def test_v1_without_quota_and_on_a_host_path(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "2:cpuacct:/\n1:cpu:/user.slice\n")
    write(tmp_path, "proc/self/mountinfo", "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n")
    cfs_quota(tmp_path, "sys/fs/cgroup/cpu/user.slice", -1)
    cfs_quota(tmp_path, "sys/fs/cgroup/cpu", -1)
    budget = read_cpu_budget(tmp_path, affinity=range(6))
    assert budget.quota is None and budget.threads == 6
    write(tmp_path, "sys/fs/cgroup/cpu/user.slice/cpu.cfs_quota_us", "400000\n")  # now the v1 quota applies
    assert read_cpu_budget(tmp_path, affinity=range(6)).threads == 4


def test_smt_siblings_count_once(tmp_path: Path) -> None:
    topology(tmp_path, {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"})
    budget = read_cpu_budget(tmp_path, affinity=range(8))
    assert (budget.affinity, budget.physical_cores, budget.threads) == (8, 4, 4)
    assert budget.source == "physical cores"
    assert read_cpu_budget(tmp_path, affinity={0, 4}).threads == 1  # two siblings of one core


def test_missing_and_malformed_files_mean_no_limit(tmp_path: Path) -> None:
    assert read_cpu_budget(tmp_path, affinity=range(3)) == CpuBudget(3, 3)
    write(tmp_path, "proc/self/cgroup", "garbage\n0::/ctr\n")
    write(tmp_path, "proc/self/mountinfo", "nonsense line\n" + V2_MOUNT)
    write(tmp_path, "sys/fs/cgroup/ctr/cpu.max", "lots 100000\n")
    assert read_cpu_budget(tmp_path, affinity=range(3)).quota is None


def test_this_machine(tmp_path: Path) -> None:
    budget = read_cpu_budget()
    assert budget.affinity == len(os.sched_getaffinity(0))
    assert 1 <= budget.threads <= budget.affinity


def test_explicit_threads_win_and_the_choice_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loraplex.engine"):
        control = ThreadControl(Settings(threads=3))
        derived = ThreadControl(Settings(adaptive_threads=False))
    assert control.max_threads == 3 and control.governor is not None and control.governor.levels == (3, 1)
    assert derived.max_threads == read_cpu_budget().threads and derived.governor is None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=threads")]
    assert lines[0] == "event=threads threads=3 source=--threads adaptive=True"
    assert lines[1].startswith(f"event=threads threads={derived.max_threads} source=")
    assert "affinity=" in lines[1] and "cgroup_quota=" in lines[1] and "physical_cores=" in lines[1]
