"""Small arithmetic the engine repeats."""
from __future__ import annotations

import os


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative a and positive b: how many b-sized pieces hold a items."""
    return -(-a // b)


def machine_cpus(boot_id_file: str = "/proc/sys/kernel/random/boot_id") -> tuple[str, list[int]]:
    """(this kernel's boot id, the CPUs this process may run on): processes with the same boot id run on one
    machine (containers share their host's kernel, so its boot id), and the CPU numbers are that machine's (a
    container sees its host's numbering), so two of them share cores when their lists meet. ("" when the boot id
    cannot be read: never taken to share.)"""
    try:
        with open(boot_id_file) as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return boot_id, sorted(os.sched_getaffinity(0))


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: those it may run on (sched_getaffinity), capped by its cgroup's CPU quota
    rounded up (cgroup v2 cpu.max "QUOTA PERIOD", v1 cpu.cfs_quota_us / cpu.cfs_period_us; "max" or -1: none).
    A container limited to 2 CPUs on a 64-CPU node gets 2, as Go's automaxprocs and the JVM count them: threads
    past the quota only wait for it. At least 1."""
    cpus = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            with open(f"{cgroup_root}/{quota_file}") as f:
                fields = f.read().split()
            if period_file is not None:
                with open(f"{cgroup_root}/{period_file}") as f:
                    fields.append(f.read().strip())
            quota, period = fields[0], fields[1]
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1") and int(period) > 0:
            return max(1, min(cpus, cdiv(int(quota), int(period))))
        break
    return max(1, cpus)
