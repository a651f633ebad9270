"""How many CPUs this process may really use: the default intra-op thread count.

    read_cpu_budget(root=Path("/"), affinity=None) -> CpuBudget
    budget.threads -> int         min(CPUs in the affinity mask, cgroup CPU quota rounded down, physical cores)
    budget.source -> str          which of the three set it, for the start-up log
    OtherLoad(cpus, root).sample() -> float | None   CPUs of ``cpus`` other processes kept busy since the last call

``os.cpu_count()`` (and torch's default) counts the node's CPUs, not this process's share: a container limited
to 2 CPUs on a 64-core node would start 64 threads whose parallel regions each wait for a descheduled member.
The quota comes from the cgroup the process is in (``/proc/self/cgroup`` located through
``/proc/self/mountinfo``), the tightest of that cgroup and its ancestors up to the mount point: v2 ``cpu.max``
(``QUOTA PERIOD`` or ``max``), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1`` = none). Physical
cores are the distinct ``core_cpus_list`` (SMT siblings) among the allowed CPUs. Every file is read below
``root`` so tests can lay out a fake ``/proc`` and ``/sys``; a file that is missing or unreadable means "no
limit from this source", never an error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["CpuBudget", "OtherLoad", "read_cpu_budget"]


@dataclass(frozen=True)
class CpuBudget:
    affinity: int  # CPUs in this process's affinity mask
    physical_cores: int  # distinct cores among them (SMT siblings counted once)
    quota: float | None = None  # CPUs the cgroup quota allows; None: no quota
    quota_file: str | None = None  # where that quota was read

    @property
    def threads(self) -> int:
        limits = [self.affinity, self.physical_cores]
        if self.quota is not None:
            limits.append(max(1, math.floor(self.quota)))
        return max(1, min(limits))

    @property
    def source(self) -> str:
        """The limit that set ``threads`` (the first of affinity, cgroup quota, physical cores at the minimum)."""
        if self.affinity == self.threads:
            return "affinity"
        if self.quota is not None and max(1, math.floor(self.quota)) == self.threads:
            return f"cgroup quota {self.quota:g} CPUs ({self.quota_file})"
        return "physical cores"


def read_cpu_budget(root: Path = Path("/"), affinity: Collection[int] | None = None) -> CpuBudget:
    """The budget of the calling process; ``affinity`` defaults to ``os.sched_getaffinity(0)``."""
    cpus = sorted(os.sched_getaffinity(0) if affinity is None else affinity)
    quota, quota_file = _cgroup_quota(root)
    return CpuBudget(len(cpus), _physical_cores(root, cpus), quota, quota_file)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _physical_cores(root: Path, cpus: list[int]) -> int:
    cores: set[str] = set()
    for cpu in cpus:
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        siblings = _read(topology / "core_cpus_list") or _read(topology / "thread_siblings_list")
        cores.add(siblings.strip() if siblings else f"cpu{cpu}")
    return max(1, len(cores))


def _cgroup_quota(root: Path) -> tuple[float | None, str | None]:
    """The tightest CPU quota over this process's cgroup (v2 and v1 cpu controller) and its ancestors."""
    best: tuple[float | None, str | None] = (None, None)
    for directory, version in _cgroup_dirs(root):
        for folder in _up_to_mount(directory):
            cpus = _quota_v2(folder) if version == 2 else _quota_v1(folder)
            if cpus is not None and (best[0] is None or cpus < best[0]):
                name = "cpu.max" if version == 2 else "cpu.cfs_quota_us"
                best = (cpus, f"cgroup v{version} /{(folder / name).relative_to(root)}")
    return best


def _quota_v2(folder: Path) -> float | None:
    text = _read(folder / "cpu.max")
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(folder: Path) -> float | None:
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _up_to_mount(directory: tuple[Path, Path]) -> Iterator[Path]:
    """The cgroup's folder, then each parent up to and including the mount point."""
    mount, folder = directory
    while True:
        yield folder
        if folder == mount or mount not in folder.parents:
            return
        folder = folder.parent


def _cgroup_dirs(root: Path) -> Iterator[tuple[tuple[Path, Path], int]]:
    """((mount point, the process's cgroup folder), version) for the v2 hierarchy and the v1 cpu controller."""
    memberships: dict[str, str] = {}  # "" (v2) or "cpu" -> the process's cgroup path
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            memberships[""] = parts[2]
        elif "cpu" in parts[1].split(","):
            memberships["cpu"] = parts[2]
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        key = "" if fstype == "cgroup2" else "cpu" if fstype == "cgroup" and "cpu" in options else None
        if key is None or key not in memberships:
            continue
        mount_root, mount_point = PurePosixPath(fields[3]), root / fields[4].lstrip("/")
        cgroup = PurePosixPath(memberships.pop(key))
        # Inside a container the mount shows only the container's subtree: its root is the cgroup path's prefix.
        try:
            relative = cgroup.relative_to(mount_root)
        except ValueError:
            relative = PurePosixPath(".")
        folder = (mount_point / str(relative)) if str(relative) != "." else mount_point
        yield (mount_point, folder if folder.is_dir() else mount_point), 2 if key == "" else 1


class OtherLoad:
    """How many of ``cpus`` other processes (and the hypervisor: steal) kept busy since the previous ``sample``.

    From ``/proc/stat`` (busy = user + nice + system + irq + softirq + steal jiffies of those CPUs) minus this
    process's own CPU time (``/proc/self/stat`` utime + stime), divided by the elapsed jiffies per CPU. None on
    the first call or when the files cannot be read. Two small file reads per call.
    """

    def __init__(self, cpus: Collection[int], root: Path = Path("/")) -> None:
        self.cpus = frozenset(f"cpu{c}" for c in cpus)
        self.root = root
        self._last: tuple[int, int, int] | None = None  # (busy, total, own) jiffies

    def _read(self) -> tuple[int, int, int] | None:
        stat, own = _read(self.root / "proc/stat"), _read(self.root / "proc/self/stat")
        if stat is None or own is None:
            return None
        busy = total = 0
        for line in stat.splitlines():
            name, _, rest = line.partition(" ")
            if name in self.cpus:
                v = [int(x) for x in rest.split()]
                busy += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
                total += sum(v[:8])
        fields = own.rsplit(")", 1)[-1].split()
        return busy, total, int(fields[11]) + int(fields[12])

    def sample(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or not self.cpus:
            return None
        elapsed = (now[1] - last[1]) / len(self.cpus)  # jiffies per CPU
        if elapsed <= 0:
            return None
        return max(0.0, ((now[0] - last[0]) - (now[2] - last[2])) / elapsed)
