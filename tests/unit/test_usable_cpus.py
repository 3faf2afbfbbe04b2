"""usable_cpus: the process's CPU affinity capped by its cgroup's CPU quota (v2 and v1 files), as a container sees
them."""
import os

import pytest
from tandem.shared.utils import usable_cpus


@pytest.fixture
def affinity():
    return len(os.sched_getaffinity(0))


def write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_no_cgroup_files_means_the_affinity(tmp_path, affinity):
    assert usable_cpus(str(tmp_path)) == affinity


@pytest.mark.parametrize("quota, period, cpus", [("150000", "100000", 2), ("100000", "100000", 1),
                                                 ("50000", "100000", 1)])
def test_a_v2_quota_caps_the_count_rounded_up(tmp_path, quota, period, cpus, affinity):
    assert usable_cpus(write(tmp_path, {"cpu.max": f"{quota} {period}\n"})) == min(cpus, affinity)


def test_a_v2_quota_of_max_is_no_cap(tmp_path, affinity):
    assert usable_cpus(write(tmp_path, {"cpu.max": "max 100000\n"})) == affinity


def test_v1_files(tmp_path, affinity):
    root = write(tmp_path, {"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert usable_cpus(root) == 1
    (tmp_path / "cpu/cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(root) == affinity


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path, affinity):
    assert usable_cpus(write(tmp_path, {"cpu.max": f"{(affinity + 8) * 100000} 100000\n"})) == affinity
