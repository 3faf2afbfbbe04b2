"""KV offloading: the block pool's link to the tiers below it (shared/kv_tiers.py), as vLLM's offloading connector
and SGLang's HiCache controller are.

- offload: when the pool evicts a cached block, its data (kv_caches[:, :, block_id]: every layer, K and V, as
  opaque elements of the pool's dtype) is copied at once, on the engine thread and before any forward can write the
  block again, into the host tier (or, without one, the disk tier); the host tier's evictions go to the disk tier.
- find: on admission, the run of blocks after the pool's hit continues through the tiers (host first), token ids
  checked as the pool checks them.
- start_load / take_finished_loads: a loader thread copies a request's hits into fresh pool blocks beside the
  engine step (host: a tensor copy; disk: read and verify the file) and reports how many leading blocks it loaded;
  a block that fails (a corrupt or missing file) ends the run there. The engine never reads those blocks meanwhile:
  they belong to the loading request alone (KVCacheManager.start_tier_load).
- What it measures: the seconds to load one block from each tier (a one-block probe at start, then a running mean
  of real loads), blocks stored, evicted, loaded and failed per tier; BlockStored / BlockRemoved events per tier
  (shared/kv_events.py), and the snapshot of every block each tier holds.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from tandem.shared.block_hash import BlockHash, HashContract
from tandem.shared.kv_block_file import TMP_SUFFIX, BlockFileHeader, read_block_file, write_block_file
from tandem.shared.kv_events import BlockRemoved, BlockStored
from tandem.shared.config import KVTierConfig
from tandem.shared.kv_disk_tier import DiskTier
from tandem.shared.kv_tiers import HostTier

log = logging.getLogger(__name__)
TIERS = ("host", "disk")  # below the pool, fastest first (shared/kv_events.py KV_TIERS[1:])
LOAD_EWMA_ALPHA = 0.2  # weight of a new load in the running mean of seconds per block
SAVE_ON_STOP_S = 10.0  # at most this long, at a clean stop, writing the pool's and host tier's blocks to disk


@dataclass(frozen=True, slots=True)
class TierHit:
    """A block a tier below the pool holds, found for a request: its hash, token ids, tier, and (host tier) its
    data, a CPU tensor no one writes."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    tier: str  # one of TIERS
    data: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Copy hits[i] into pool block dst_block_ids[i], in order, stopping at the first that fails."""

    request_id: str
    dst_block_ids: tuple[int, ...]
    hits: tuple[TierHit, ...]


@dataclass(frozen=True, slots=True)
class FinishedLoad:
    request_id: str
    num_loaded: int  # leading blocks of the job now in the pool


class KVOffloader:
    """The tiers of one pool (kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, row], any dtype).
    Methods run on the engine thread; the loader thread only copies into the blocks of its jobs."""

    def __init__(self, config: KVTierConfig, kv_caches: torch.Tensor, contract: HashContract,
                 record_events: bool = False):
        self.kv_caches = kv_caches
        self.block_shape = tuple(kv_caches.shape[:2] + kv_caches.shape[3:])
        self.block_bytes = kv_caches[:, :, 0].numel() * kv_caches.element_size()
        self.host = self.disk = None
        if config.host_bytes >= self.block_bytes:
            self.host = HostTier(config.host_bytes, config.eviction)
        if config.has_disk and config.disk_bytes >= self.block_bytes:
            self.disk = DiskTier(config.disk_dir, config.disk_bytes, config.eviction, contract.root_hash.hex(),
                                 kv_caches.dtype, self.block_shape)  # fmt: skip
        if config.enabled and self.host is None and self.disk is None:
            log.warning("KV tiers smaller than one block (%d bytes): off", self.block_bytes)
        if self.host is not None:
            log.info("host KV tier: %d blocks of %.2f MB (%.2f GiB), evicting %s",
                     config.host_bytes // self.block_bytes, self.block_bytes / 1e6, config.host_bytes / 2**30,
                     config.eviction)  # fmt: skip
        if self.disk is not None:
            log.info("disk KV tier %s: %.2f GiB, %d blocks held, evicting %s", self.disk.directory,
                     self.disk.capacity_bytes / 2**30, len(self.disk.blocks), config.eviction)  # fmt: skip
        self.record_events = record_events
        self._events: list[BlockStored | BlockRemoved] = []
        self.num_stored, self.num_evicted, self.num_loaded, self.num_failed = ({t: 0 for t in self.tiers}
                                                                               for _ in range(4))
        self.load_s_per_block: dict[str, float] = {}  # tier -> measured seconds to load one block
        self._pending: dict[str, LoadJob] = {}  # request id -> its load in flight
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._finished: list[FinishedLoad] = []
        self._done = threading.Condition()  # guards _finished
        self._stream = torch.cuda.Stream(kv_caches.device) if kv_caches.device.type == "cuda" else None
        if self.disk is not None and record_events and self.disk.blocks:  # (a restart with a warm disk tier)
            self._events.append(BlockStored(tuple(self.disk.hashes()), "disk"))
        self._probe()
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader", daemon=True)
        self._loader.start()

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(t for t in TIERS if getattr(self, t) is not None)

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    # -- pool -> tiers -------------------------------------------------------------------------------------
    def offload(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """The pool evicts this cached block: keep a copy of its data below it (a block a tier already holds is
        only touched there)."""
        if self.host is None:
            if self.disk is not None and not self.disk.touch(block_hash):
                self._put_disk(block_hash, token_ids, self._copy_out(block_id))
            return
        if self.host.touch(block_hash):
            return
        self._stored("host", block_hash)
        for victim, block in self.host.put(block_hash, token_ids, self._copy_out(block_id)):
            self._evicted("host", victim)
            if self.disk is not None and not self.disk.touch(victim):
                self._put_disk(victim, block.token_ids, block.data)

    def _copy_out(self, block_id: int) -> torch.Tensor:
        # [num_layers, 2, block_size, num_kv_heads, row], contiguous, on the CPU
        return self.kv_caches[:, :, block_id].to("cpu", copy=True).contiguous()

    def _put_disk(self, block_hash: BlockHash, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        self._stored("disk", block_hash)
        for victim in self.disk.put(block_hash, token_ids, data):
            self._evicted("disk", victim)

    def _stored(self, tier: str, block_hash: BlockHash) -> None:
        self.num_stored[tier] += 1
        if self.record_events:
            self._events.append(BlockStored((block_hash,), tier))

    def _evicted(self, tier: str, block_hash: BlockHash) -> None:
        self.num_evicted[tier] += 1
        if self.record_events:
            self._events.append(BlockRemoved((block_hash,), tier))

    # -- tiers -> pool -------------------------------------------------------------------------------------
    def find(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> TierHit | None:
        """The fastest tier's copy of exactly this block, or None."""
        if self.host is not None and (block := self.host.get(block_hash, token_ids)) is not None:
            return TierHit(block_hash, token_ids, "host", block.data)
        if self.disk is not None and self.disk.get(block_hash, token_ids):
            return TierHit(block_hash, token_ids, "disk")
        return None

    def touch(self, hits: list[TierHit]) -> None:
        """A use of these blocks: each moves up in its tier's eviction order (before the pool makes room for them,
        which may push other blocks down the tiers)."""
        for hit in hits:
            getattr(self, hit.tier).touch(hit.block_hash)

    def start_load(self, request_id: str, dst_block_ids: list[int], hits: list[TierHit]) -> None:
        """Copy hits into these pool blocks (held by the request alone until take_finished_loads reports it). A
        disk block evicted meanwhile is a miss; a host block's data is the hit's own reference."""
        job = LoadJob(request_id, tuple(dst_block_ids), tuple(hits))
        self._pending[request_id] = job
        self._jobs.put(job)

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._pending)

    def take_finished_loads(self) -> list[FinishedLoad]:
        """The loads done since the last call (counted per tier here)."""
        with self._done:
            finished, self._finished = self._finished, []
        for f in finished:
            job = self._pending.pop(f.request_id)
            for hit in job.hits[: f.num_loaded]:
                self.num_loaded[hit.tier] += 1
            if f.num_loaded < len(job.hits):
                failed = job.hits[f.num_loaded]
                self.num_failed[failed.tier] += 1
                if failed.tier == "host" and self.host.get(failed.block_hash, failed.token_ids) is not None:
                    self.host.remove(failed.block_hash)  # (never tried again; a disk block left on its own)
                    if self.record_events:
                        self._events.append(BlockRemoved((failed.block_hash,), "host"))
        return finished

    def wait_for_load(self, timeout_s: float) -> None:
        """Block until some load finishes (or timeout_s passes): an engine with nothing else to do."""
        with self._done:
            if not self._finished:
                self._done.wait(timeout_s)

    def _load_loop(self) -> None:
        """Loader thread: run each job, then report it."""
        while (job := self._jobs.get()) is not None:
            num_loaded = 0
            try:
                for dst, hit in zip(job.dst_block_ids, job.hits):
                    start = time.perf_counter()
                    data = hit.data if hit.tier == "host" else self.disk.read(hit.block_hash, hit.token_ids)
                    if data is None:
                        break
                    self._copy_in(dst, data)
                    self._observe(hit.tier, time.perf_counter() - start)
                    num_loaded += 1
            except Exception:  # (a bug fails this block: the request computes from there)
                log.exception("KV tier load for request %s failed", job.request_id)
            with self._done:
                self._finished.append(FinishedLoad(job.request_id, num_loaded))
                self._done.notify_all()

    def _copy_in(self, block_id: int, data: torch.Tensor) -> None:
        if self._stream is None:
            self.kv_caches[:, :, block_id].copy_(data)
            return
        with torch.cuda.stream(self._stream):  # (beside the step's stream)
            self.kv_caches[:, :, block_id].copy_(data, non_blocking=True)
        self._stream.synchronize()

    def _observe(self, tier: str, seconds: float) -> None:
        last = self.load_s_per_block.get(tier)
        self.load_s_per_block[tier] = seconds if last is None else last + LOAD_EWMA_ALPHA * (seconds - last)

    def _probe(self) -> None:
        """A first figure per tier before any hit: load pool block 0 (nothing uses it yet) from each tier into
        itself. The disk probe writes a file, drops it from the page cache where the OS allows, and reads it
        back checked."""
        if self.host is not None:
            data = self._copy_out(0)
            start = time.perf_counter()
            self._copy_in(0, data)
            self._observe("host", time.perf_counter() - start)
        if self.disk is not None:
            path = self.disk.directory / f"probe{TMP_SUFFIX}"
            probe_hash = bytes(16)
            header = BlockFileHeader(self.disk.contract, probe_hash, (), str(self.kv_caches.dtype).removeprefix(
                "torch."), self.block_shape)  # fmt: skip
            try:
                write_block_file(path, header, self._copy_out(0))
                if hasattr(os, "posix_fadvise"):
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                start = time.perf_counter()
                self._copy_in(0, read_block_file(path, self.disk.contract, probe_hash, (), self.kv_caches.dtype,
                                                 self.block_shape))  # fmt: skip
                self._observe("disk", time.perf_counter() - start)
            except OSError as e:
                log.warning("disk KV tier probe failed: %s", e)
            finally:
                path.unlink(missing_ok=True)

    # -- what it holds -------------------------------------------------------------------------------------
    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The tiers' changes since the last call, in order (a disk file found corrupt or unwritable: removed)."""
        if self.disk is not None:
            removed = self.disk.take_removed()
            if removed and self.record_events:
                self._events.append(BlockRemoved(tuple(removed), "disk"))
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[tuple[BlockHash, str]]:
        """Every block the tiers hold, with its tier (a block in both appears twice)."""
        held = [(h, "host") for h in self.host.blocks] if self.host is not None else []
        return held + ([(h, "disk") for h in self.disk.hashes()] if self.disk is not None else [])

    def num_blocks(self) -> dict[str, int]:
        """Blocks each tier holds now."""
        return {t: len(getattr(self, t).blocks) for t in self.tiers}

    def flush(self) -> None:
        """Wait for the disk tier's writes asked for so far (a test's clean restart)."""
        if self.disk is not None:
            self.disk.flush()

    def save_to_disk(self, pool_blocks: list[tuple[int, BlockHash, tuple[int, ...]]]) -> int:
        """A clean stop: write the blocks the host tier holds, then pool_blocks ((block id, hash, token ids) of the
        pool's cached blocks), coldest first, to the disk tier, so that a restart finds them too (the hottest last:
        the disk tier's bound evicts the coldest). At most SAVE_ON_STOP_S. Returns the blocks written."""
        if self.disk is None:
            return 0
        host = [(None, h, self.host.blocks[h].token_ids) for h in self.host.order] if self.host is not None else []
        start, num_written = time.perf_counter(), 0
        for block_id, block_hash, token_ids in host + pool_blocks:
            if time.perf_counter() - start > SAVE_ON_STOP_S:
                break
            if self.disk.touch(block_hash):
                continue
            data = self.host.blocks[block_hash].data if block_id is None else self._copy_out(block_id)
            self._put_disk(block_hash, token_ids, data)
            num_written += 1
            if num_written % 64 == 0:
                self.disk.flush()  # (bounds the copies waiting for the writer)
        self.disk.flush()
        log.info("disk KV tier: %d blocks of the pool and host tier written for the next start in %.1f s",
                 num_written, time.perf_counter() - start)
        return num_written

    def close(self) -> None:
        """Stop the loader thread; finish the disk tier's writes and stop its writer."""
        self._jobs.put(None)
        self._loader.join(timeout=30)
        if self.disk is not None:
            self.disk.close()
