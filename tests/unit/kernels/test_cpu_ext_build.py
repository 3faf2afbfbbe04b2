"""The CPU kernels' build: a lock left by a killed build is removed (torch would wait on it forever); a lock
of a build that may still be running is kept."""
import os
import time

from tandem.kernels import cpu_ext


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - cpu_ext.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    cpu_ext._remove_stale_lock(stale)
    cpu_ext._remove_stale_lock(fresh)
    cpu_ext._remove_stale_lock(tmp_path / "none" / "lock")  # (no lock: nothing to do)
    assert not stale.exists() and fresh.exists()
