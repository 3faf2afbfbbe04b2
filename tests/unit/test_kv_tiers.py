"""The KV tiers below the pool with small objects: exact spill order pool -> host -> disk and the tiers' bounds, a hit
loaded beside the steps and published, atomic and checked block files (a crash mid-write and a corrupted file are
misses), a restart that finds its blocks again, an abort during a load."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.shared.block_hash import HashContract, hash_request_blocks
from tandem.shared.config import KVTierConfig, SchedulerConfig
from tandem.shared.engine_args import EngineArgs
from tandem.shared.kv_block_file import block_file_name
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.kv_offload import KVOffloader
from tandem.shared.kv_disk_tier import DiskTier, claim_slot
from tandem.shared.kv_tiers import EvictionOrder
from tandem.shared.request import Request, RequestStatus, SamplingParams
from tandem.shared.scheduler import Scheduler

BS = 4
CONTRACT = HashContract(BS, "m:abc:fp32", "fp32")
A, B, C = range(1, 14), range(100, 113), range(200, 213)  # 3 full blocks + 1 token each


def make_pool(num_blocks=6) -> torch.Tensor:
    return torch.zeros(2, 2, num_blocks, BS, 1, 2)  # [layers, K/V, blocks, block_size, heads, row]


def make_tiers(kv_caches, tmp_path, host_blocks=2, disk_blocks=2, eviction="lru", contract=CONTRACT):
    block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
    config = KVTierConfig(host_blocks * block_bytes, str(tmp_path / "disk"), disk_blocks * block_bytes, eviction)
    return KVOffloader(config, kv_caches, contract, record_events=True)


def make_scheduler(kv_caches, offloader) -> Scheduler:
    kv = KVCacheManager(kv_caches.shape[2], BS, CONTRACT, record_events=True, offloader=offloader)
    return Scheduler(SchedulerConfig(64, 8), kv)


def step(scheduler, kv_caches):
    """One schedule; 'computes' each scheduled token by writing its id into its slot (every layer, K and V)."""
    out = scheduler.schedule()
    kv = scheduler.kv_cache_manager
    for r in out.scheduled_requests:
        table = kv.get_block_table(r.request_id)
        for p in range(r.num_computed_tokens, r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]):
            kv_caches[:, :, table[p // BS], p % BS] = float(r.token_ids(p, p + 1)[0])
        r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
        kv.cache_full_blocks(r)
    return out


def run(scheduler, kv_caches, rid, tokens, finish=True):
    """Admit a prompt, wait for any tier load, compute it; returns the request (freed unless finish is False)."""
    request = Request(rid, list(tokens), SamplingParams(max_tokens=1))
    scheduler.add_request(request)
    while not step(scheduler, kv_caches).scheduled_requests:
        assert request.status == RequestStatus.LOADING_KV
        scheduler.kv_cache_manager.offloader.wait_for_load(5.0)
    table = scheduler.kv_cache_manager.get_block_table(rid)
    assert all(bool((kv_caches[:, :, table[p // BS], p % BS] == tokens[p]).all()) for p in range(len(tokens)))
    if finish:
        scheduler.remove_request(request)
        scheduler.kv_cache_manager.free(request)
    return request


def hashes(tokens):
    return hash_request_blocks(list(tokens), CONTRACT)


def events(kv):
    return [(type(e).__name__, e.tier, e.block_hashes) for e in kv.block_pool.take_events()]


def test_eviction_order_lru_and_lfu():
    for policy, expected in (("lru", [b"c", b"a", b"b"]), ("lfu", [b"c", b"b", b"a"])):
        order = EvictionOrder(policy)
        for key in (b"a", b"b", b"c"):
            order.add(key)
        order.touch(b"a")
        order.touch(b"a")
        order.touch(b"b")
        assert list(order) == expected, policy
        assert order.victim() == expected[0]
        order.remove(expected[0])
        assert order.victim() == expected[1]


def test_evicted_blocks_spill_pool_to_host_to_disk_in_lru_order(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path)
    scheduler = make_scheduler(kv_caches, offloader)
    kv = scheduler.kv_cache_manager
    a, b, c = hashes(A), hashes(B), hashes(C)
    run(scheduler, kv_caches, "a", A)
    assert events(kv) == [("BlockStored", "pool", tuple(a))]
    run(scheduler, kv_caches, "b", B)  # 6 blocks: a's never-full 4th and free ones go first, then a's tail
    assert events(kv) == [("BlockRemoved", "pool", (a[2],)), ("BlockStored", "pool", tuple(b)),
                          ("BlockStored", "host", (a[2],))]  # fmt: skip
    run(scheduler, kv_caches, "c", C)  # the host tier holds 2: a[2] goes on to disk, then a[1]
    assert events(kv) == [
        ("BlockRemoved", "pool", (a[1], a[0], b[2])), ("BlockStored", "pool", tuple(c)),
        ("BlockStored", "host", (a[1], a[0])), ("BlockRemoved", "host", (a[2],)), ("BlockStored", "disk", (a[2],)),
        ("BlockStored", "host", (b[2],)), ("BlockRemoved", "host", (a[1],)), ("BlockStored", "disk", (a[1],))]
    offloader.flush()
    assert sorted(os.listdir(offloader.disk.directory)) == sorted(block_file_name(h) for h in (a[1], a[2]))
    assert sorted(kv.cached_block_tiers()) == sorted([(h, "pool") for h in b[:2] + c] + [(a[0], "host"),
                                                     (b[2], "host"), (a[1], "disk"), (a[2], "disk")])  # fmt: skip
    assert offloader.num_stored == {"host": 4, "disk": 2} and offloader.num_evicted == {"host": 2, "disk": 0}
    offloader.close()


def test_a_hit_below_the_pool_loads_beside_the_step_and_is_published(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=2, disk_blocks=4)
    scheduler = make_scheduler(kv_caches, offloader)
    kv = scheduler.kv_cache_manager
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        run(scheduler, kv_caches, rid, tokens)
    events(kv)
    # a's 3 full blocks: a[0] in the host tier, a[1] and a[2] on disk (maybe still being written)
    first = Request("a2", list(A), SamplingParams(max_tokens=1))
    second = Request("a3", list(A) + [7, 7, 7], SamplingParams(max_tokens=1))
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = step(scheduler, kv_caches)  # first starts its load; second waits for those blocks (in flight)
    assert out.scheduled_requests == [] and first.status == RequestStatus.LOADING_KV
    assert second.status == RequestStatus.WAITING and len(kv.tier_loads["a2"].block_ids) == 3
    while not out.scheduled_requests:
        offloader.wait_for_load(5.0)
        out = step(scheduler, kv_caches)
    assert out.scheduled_requests[0] is first and out.num_scheduled_tokens["a2"] == 1
    assert first.num_cached_tokens == 12 and offloader.num_loaded == {"host": 1, "disk": 2}
    a = hashes(A)
    assert ("BlockStored", "pool", tuple(a)) in events(kv)
    out = step(scheduler, kv_caches)  # second takes the loaded blocks from the pool
    assert second.num_cached_tokens == 12 and kv.get_block_table("a3")[:3] == kv.get_block_table("a2")[:3]
    assert set(offloader.load_s_per_block) == {"host", "disk"}  # (probed at start, then measured)
    offloader.close()


def test_a_hit_the_pool_has_no_room_to_load_waits_for_room_instead_of_being_computed(tmp_path):
    """Pool of 6 blocks, a's 3 blocks in the tiers, b (4 blocks) running: a's load cannot start, though a chunk of 8
    tokens (2 blocks) of it could be computed. It waits, first in line (c, behind it, waits too), and is loaded,
    not computed in chunks, once b ends."""
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=4, disk_blocks=4)
    scheduler = make_scheduler(kv_caches, offloader)
    kv = scheduler.kv_cache_manager
    for rid, tokens in (("a", A), ("x", C)):  # (a's blocks go to the host tier)
        run(scheduler, kv_caches, rid, tokens)
    b = run(scheduler, kv_caches, "b", B, finish=False)  # holds 4 of the 6 blocks
    scheduler.config = SchedulerConfig(8, 8)  # (a step's budget: 8 tokens)
    again = Request("a2", list(A), SamplingParams(max_tokens=1))
    behind = Request("c", [9] * 5, SamplingParams(max_tokens=1))
    scheduler.add_request(again)
    scheduler.add_request(behind)
    for _ in range(3):
        assert step(scheduler, kv_caches).scheduled_requests == [] and again.status == RequestStatus.WAITING
    assert not kv.tier_loads and behind.status == RequestStatus.WAITING
    scheduler.remove_request(b)
    kv.free(b)
    out = step(scheduler, kv_caches)
    assert again.status == RequestStatus.LOADING_KV
    while again.request_id not in out.num_scheduled_tokens:
        offloader.wait_for_load(5.0)
        out = step(scheduler, kv_caches)
    assert out.num_scheduled_tokens["a2"] == 1 and again.num_tier_cached_tokens == {"host": 12}
    offloader.close()


def test_block_files_are_atomic_and_checked_and_a_bad_one_is_a_miss(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=0, disk_blocks=8)
    scheduler = make_scheduler(kv_caches, offloader)
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        run(scheduler, kv_caches, rid, tokens)
    offloader.flush()
    a = hashes(A)
    disk = offloader.disk.directory
    blob = bytearray((disk / block_file_name(a[1])).read_bytes())
    blob[len(blob) // 2] ^= 1  # a flipped bit in a[1]'s KV
    (disk / block_file_name(a[1])).write_bytes(blob)
    # a's blocks are all on disk: a[0] loads, a[1] fails and ends the hit: a[1] and a[2] are computed again
    assert run(scheduler, kv_caches, "a2", A).num_cached_tokens == 4  # (its KV checked against the tokens in run)
    kv = scheduler.kv_cache_manager
    assert offloader.num_failed["disk"] == 1 and ("BlockRemoved", "disk", (a[1],)) in events(kv)
    offloader.flush()
    assert not (disk / block_file_name(a[1])).exists()
    offloader.close()
    # a crash mid-write: a temporary file, and a final name holding half a file (a disk that lied about fsync)
    good = (disk / block_file_name(a[0])).read_bytes()
    (disk / (block_file_name(a[2]) + ".123.tmp")).write_bytes(good)
    (disk / block_file_name(a[2])).write_bytes(good[: len(good) // 2])
    restarted = make_tiers(kv_caches, tmp_path, host_blocks=0, disk_blocks=8)
    assert a[2] not in restarted.disk.blocks and a[0] in restarted.disk.blocks
    assert sorted(os.listdir(disk)) == sorted(block_file_name(h) for h in restarted.disk.blocks)
    restarted.close()


def test_a_restarted_instance_loads_its_disk_blocks(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=1, disk_blocks=8)
    scheduler = make_scheduler(kv_caches, offloader)
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        run(scheduler, kv_caches, rid, tokens)
    offloader.close()
    on_disk = set(offloader.disk.hashes())
    kv_caches = make_pool()
    restarted = make_tiers(kv_caches, tmp_path, host_blocks=1, disk_blocks=8)
    scheduler = make_scheduler(kv_caches, restarted)
    kv = scheduler.kv_cache_manager
    assert events(kv) == [("BlockStored", "disk", tuple(restarted.disk.hashes()))]
    assert set(restarted.disk.hashes()) == on_disk and set(kv.cached_block_tiers()) == {(h, "disk") for h in on_disk}
    assert run(scheduler, kv_caches, "a2", A).num_cached_tokens == 12  # (its KV checked against the tokens in run)
    assert restarted.disk.directory == offloader.disk.directory  # (the slot the first one held)
    other = HashContract(BS, "m:other:fp32", "fp32")  # beside it, another model: a slot of its own contract's,
    beside = make_tiers(make_pool(), tmp_path, contract=other)  # serving none of the first one's blocks
    assert beside.snapshot() == [] and beside.disk.directory.parent != restarted.disk.directory.parent
    second = make_tiers(make_pool(), tmp_path)  # a second live instance of the first contract: the next slot
    assert second.disk.directory.name == "slot-1" and second.snapshot() == []
    for tiers in (restarted, beside, second):
        tiers.close()
    assert make_tiers(make_pool(), tmp_path).disk.directory.name == "slot-0"  # (closed: free again)


def test_a_disk_slot_held_by_a_live_process_is_never_shared(tmp_path):
    """The slot lock is the OS's (flock): a process that holds it keeps it from every other process until it
    exits, however it exits."""
    code = ("import sys, time; from pathlib import Path; from tandem.shared.kv_disk_tier import claim_slot; "
            "print(claim_slot(Path(sys.argv[1]))[0].name, flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-P", "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "slot-0"
        path, fd = claim_slot(tmp_path)
        assert path.name == "slot-1"
        os.close(fd)
    finally:
        holder.kill()
        holder.wait()
    path, fd = claim_slot(tmp_path)  # (killed: its lock went with it)
    assert path.name == "slot-0"
    os.close(fd)


def test_an_abort_during_a_load_frees_its_blocks_when_the_load_ends(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=4, disk_blocks=0)
    scheduler = make_scheduler(kv_caches, offloader)
    kv = scheduler.kv_cache_manager
    for rid, tokens in (("a", A), ("b", B), ("c", C)):
        run(scheduler, kv_caches, rid, tokens)
    request = Request("a2", list(A), SamplingParams(max_tokens=1))
    scheduler.add_request(request)
    step(scheduler, kv_caches)
    assert request.status == RequestStatus.LOADING_KV
    loading = kv.tier_loads["a2"].block_ids
    scheduler.remove_request(request)
    kv.free(request)
    assert not set(loading) & set(kv.block_pool.free_block_queue)  # (the loader may still write them)
    offloader.wait_for_load(5.0)
    step(scheduler, kv_caches)
    assert set(loading) <= set(kv.block_pool.free_block_queue) and not kv.tier_loads
    assert kv.num_free_blocks == 6
    offloader.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_a_pool_of_any_element_type_round_trips_through_both_tiers(dtype, tmp_path):
    """The tiers move a block's elements as they are (a quantized pool: uint8 rows of codes and scales)."""
    kv_caches = (torch.arange(2 * 2 * 6 * BS * 68) % 251).reshape(2, 2, 6, BS, 1, 68).to(dtype)
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=1, disk_blocks=4)
    h1, h2 = b"1" * 16, b"2" * 16
    offloader.offload(1, h1, (1, 2, 3, 4))
    offloader.offload(2, h2, (5, 6, 7, 8))  # (h1 goes on to disk)
    offloader.flush()
    hits = [offloader.find(h1, (1, 2, 3, 4)), offloader.find(h2, (5, 6, 7, 8))]
    assert [hit.tier for hit in hits] == ["disk", "host"]
    offloader.start_load("r", [4, 5], hits)
    offloader.wait_for_load(5.0)
    assert offloader.take_finished_loads()[0].num_loaded == 2
    assert torch.equal(kv_caches[:, :, 4:6], kv_caches[:, :, 1:3])
    offloader.close()


def test_engine_args_make_the_tier_config():
    args = EngineArgs(kv_host_tier_gib=0.5, kv_disk_tier_dir="/kv", kv_disk_tier_gib=2, kv_tier_eviction="lfu")
    assert args.create_kv_tier_config() == KVTierConfig(1 << 29, "/kv", 2 << 30, "lfu")
    assert not EngineArgs().create_kv_tier_config().enabled


def make_disk_tier(root, capacity_blocks=8, contract=CONTRACT):
    data = torch.zeros(2, 2, BS, 1, 2)
    tier = DiskTier(root, capacity_blocks * data.numel() * 4, "lru", contract.root_hash.hex(), torch.float32,
                    tuple(data.shape))  # fmt: skip
    return tier, data


def test_a_full_filesystem_shrinks_the_disk_tier_and_a_deleted_directory_is_made_again(tmp_path, monkeypatch):
    import errno

    from tandem.shared import kv_disk_tier

    tier, data = make_disk_tier(tmp_path)
    h = hashes(list(range(1, 4 * BS + 1)))
    for i in range(3):
        tier.put(h[i], (i,), data + i)
    tier.flush()
    real_write, calls = kv_disk_tier.write_block_file, []

    def full_once(path, header, payload):  # the filesystem is full for one write
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, header, payload)

    monkeypatch.setattr(kv_disk_tier, "write_block_file", full_once)
    tier.put(h[3], (3,), data + 3)
    tier.flush()
    assert len(calls) == 2 and tier.capacity_bytes == 2 * tier.blocks[h[3]].nbytes  # (held 4, freed twice a block)
    assert set(tier.hashes()) == {h[2], h[3]} and set(tier.take_removed()) == {h[0], h[1]}
    assert sorted(os.listdir(tier.directory)) == sorted(block_file_name(x) for x in (h[2], h[3]))
    assert tier.num_write_failures == 0 and tier.read(h[3], (3,)) is not None
    monkeypatch.setattr(kv_disk_tier, "write_block_file", real_write)
    shutil.rmtree(tier.directory)  # deleted under a running instance: made again at the next write
    tier.put(h[0], (0,), data)
    tier.flush()
    assert (tier.directory / block_file_name(h[0])).exists() and tier.num_write_failures == 0
    tier.close()


def test_another_contracts_directory_is_deleted_once_no_live_instance_holds_it(tmp_path):
    other = HashContract(BS, "m:other:fp32", "fp32")
    old, _ = make_disk_tier(tmp_path, contract=other)  # a live instance of another model
    new, _ = make_disk_tier(tmp_path)
    assert old.directory.exists()  # (held: kept)
    old.close()
    newer, _ = make_disk_tier(tmp_path)  # (old's slot is free now: its contract's directory goes)
    assert not old.directory.parent.exists() and newer.directory.parent == new.directory.parent
    new.close(), newer.close()


def test_an_infinite_or_negative_tier_size_is_refused_by_name():
    import argparse

    from tandem.services.flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for value in ("inf", "-1", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-host-tier-gib", value])


def test_a_clean_stop_writes_the_pools_and_host_tiers_blocks_to_disk_for_the_next_start(tmp_path):
    kv_caches = make_pool()
    offloader = make_tiers(kv_caches, tmp_path, host_blocks=1, disk_blocks=8)
    scheduler = make_scheduler(kv_caches, offloader)
    for rid, tokens in (("a", A), ("b", B)):  # b evicts a's tail to the host tier; the rest stays in the pool
        run(scheduler, kv_caches, rid, tokens)
    held = scheduler.kv_cache_manager.cached_block_tiers()
    assert {t for _, t in held} == {"pool", "host"} and not offloader.disk.blocks
    assert offloader.save_to_disk(scheduler.kv_cache_manager.block_pool.cached_blocks_coldest_first()) == len(held)
    offloader.close()
    kv_caches = make_pool()
    restarted = make_tiers(kv_caches, tmp_path, host_blocks=1, disk_blocks=8)
    assert set(restarted.disk.hashes()) == {h for h, _ in held}
    scheduler = make_scheduler(kv_caches, restarted)
    assert run(scheduler, kv_caches, "a2", A).num_tier_cached_tokens == {"disk": 12}  # (token ids checked in run)
    assert run(scheduler, kv_caches, "b2", B).num_tier_cached_tokens == {"disk": 12}
    restarted.close()
