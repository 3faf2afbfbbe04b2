"""The disk KV tier (below the host tier: shared/kv_tiers.py, which also has the eviction order both use).

The disk tier writes on a thread of its own, in order (write to a temporary name, fsync, rename), and reads on the
loader's thread; its index is guarded by a lock. Its files live in a slot of the directory it is given,
DIR/<hash contract id>/slot-N, locked (flock) while the process runs: instances sharing DIR never share a slot, and
a restarted one (a new instance id) takes over the free slot of the one that is gone. When it starts it deletes
temporary files (a write a crash cut short), reads the header of every block file and indexes those written under
its hash contract (others are deleted), oldest first, so a restarted instance finds its blocks by hash. A file that
fails any check when read (checksum, header, size) or is gone is a miss: the block leaves the index, never serves
wrong KV.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import queue
import shutil
import threading
from pathlib import Path

import torch

from tandem.shared.block_hash import BlockHash
from tandem.shared.kv_block_file import (SUFFIX, TMP_SUFFIX, BlockFileHeader, CorruptBlockFile, block_file_name,
                                         read_block_file, read_block_header, write_block_file)
from tandem.shared.kv_tiers import EvictionOrder, TierBlock

log = logging.getLogger(__name__)


def _locked(lock_file: Path) -> bool:
    """Whether a live process holds this slot lock (claim_slot)."""
    try:
        fd = os.open(lock_file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (drops the lock if this took it)


def remove_other_contracts(root: Path, contract_dir: str) -> None:
    """Delete the directories under root of other hash contracts (another model, weight format, KV dtype or block
    size: their blocks can never match) whose slots no live process holds: what an instance started under another
    configuration left, which would otherwise fill the disk forever."""
    for other in root.iterdir() if root.is_dir() else ():
        if other.name == contract_dir or not other.is_dir() or any(map(_locked, other.glob("slot-*.lock"))):
            continue
        log.info("disk KV tier: deleting %s, left by instances of another hash contract", other)
        shutil.rmtree(other, ignore_errors=True)


def claim_slot(root: Path) -> tuple[Path, int]:
    """The first directory root/slot-N (N = 0, 1, ...) whose lock file root/slot-N.lock this process can take, and
    the lock's file descriptor (held until the process exits or closes it: the OS drops the lock of a dead process).
    So instances sharing a root never share a slot, and a restarted instance (under a new instance id) takes over
    the slot, and the blocks, of one that is gone."""
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        fd = os.open(root / f"slot-{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        (root / f"slot-{n}").mkdir(exist_ok=True)
        return root / f"slot-{n}", fd


class DiskTier:
    """Block files, at most capacity_bytes of them, for one hash contract (contract: its root hash hex) and one block
    layout (dtype, shape: a pool block's, kv_caches[:, :, i]), in a slot of root (root/<contract[:16]>/slot-N,
    claim_slot) that this instance holds while it runs.

    Engine thread: get, touch, put, take_removed, hashes. Loader thread: read. Its own writer thread writes
    and deletes files, in the order asked."""

    def __init__(self, root: str | Path, capacity_bytes: int, eviction: str, contract: str,
                 dtype: torch.dtype, shape: tuple[int, ...]):
        remove_other_contracts(Path(root), contract[:16])
        self.directory, self._slot_lock = claim_slot(Path(root) / contract[:16])
        self.capacity_bytes = capacity_bytes
        self.contract, self.dtype, self.shape = contract, dtype, tuple(shape)
        self.blocks: dict[BlockHash, TierBlock] = {}
        self.order = EvictionOrder(eviction)
        self.num_bytes = 0
        self.num_failures = 0  # reads that found a corrupt or missing file, and writes that failed, since start
        self.num_write_failures = 0  # of those, writes
        self._lock = threading.Lock()  # guards blocks, order, num_bytes, _removed
        self._removed: list[BlockHash] = []  # left the index off the engine thread (failed read or write)
        self._jobs: queue.Queue = queue.Queue()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def path(self, block_hash: BlockHash) -> Path:
        return self.directory / block_file_name(block_hash)

    def _scan(self) -> None:
        """Index the block files a previous run of this instance left, oldest first; delete temporary files,
        unreadable ones, other contracts' and other layouts', and the oldest beyond the capacity."""
        files = []
        for path in self.directory.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)
            elif path.name.endswith(SUFFIX):
                try:
                    header, stat = read_block_header(path), path.stat()
                except (CorruptBlockFile, OSError) as e:
                    log.warning("disk KV tier: deleting %s: %s", path, e)
                    path.unlink(missing_ok=True)
                    continue
                layout = (header.contract, header.dtype, header.shape, path.name)
                if layout != (self.contract, str(self.dtype).removeprefix("torch."), self.shape,
                              block_file_name(header.block_hash)):  # fmt: skip
                    path.unlink(missing_ok=True)
                    continue
                files.append((stat.st_mtime, header))
        itemsize = self.dtype.itemsize
        for _, header in sorted(files, key=lambda f: f[0]):
            size = itemsize * int(torch.Size(header.shape).numel())  # (the payload, as put counts it)
            self.blocks[header.block_hash] = TierBlock(header.token_ids, None, size)
            self.order.add(header.block_hash)
            self.num_bytes += size
        free = shutil.disk_usage(self.directory).free
        if self.capacity_bytes > self.num_bytes + free:  # (a logical bound the filesystem cannot hold)
            log.warning("disk KV tier %s: %.2f GiB asked for, %.2f GiB free there: the tier holds at most that",
                        self.directory, self.capacity_bytes / 2**30, (self.num_bytes + free) / 2**30)
            self.capacity_bytes = self.num_bytes + free
        for block_hash in self._evict_to(self.capacity_bytes):
            self.path(block_hash).unlink(missing_ok=True)
        if self.blocks:
            log.info("disk KV tier %s: %d blocks (%.1f MB) from an earlier run", self.directory, len(self.blocks),
                     self.num_bytes / 1e6)

    def hashes(self) -> list[BlockHash]:
        with self._lock:
            return list(self.blocks)

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Whether the tier holds exactly these tokens under this hash."""
        with self._lock:
            block = self.blocks.get(block_hash)
            return block is not None and block.token_ids == token_ids

    def touch(self, block_hash: BlockHash) -> bool:
        """A use of the block, if the tier holds it (False: it does not)."""
        with self._lock:
            if block_hash not in self.order:
                return False
            self.order.touch(block_hash)
            return True

    def put(self, block_hash: BlockHash, token_ids: tuple[int, ...], data: torch.Tensor) -> list[BlockHash]:
        """Hold a block: indexed at once (reads serve data until the file is written), written by the writer
        thread. Returns the hashes evicted to make room (maybe the block itself)."""
        nbytes = data.numel() * data.element_size()  # (the payload; the file's header adds a little)
        with self._lock:
            assert block_hash not in self.blocks
            block = TierBlock(token_ids, data, nbytes)
            self.blocks[block_hash] = block
            self.order.add(block_hash)
            self.num_bytes += nbytes
            evicted = self._evict_to(self.capacity_bytes)
        if block_hash not in evicted:
            self._jobs.put((block_hash, block))
        for victim in evicted:
            self._jobs.put((victim, None))
        return evicted

    def _evict_to(self, capacity_bytes: int) -> list[BlockHash]:
        evicted = []
        while self.num_bytes > capacity_bytes:
            victim = self.order.victim()
            self.order.remove(victim)
            self.num_bytes -= self.blocks.pop(victim).nbytes
            evicted.append(victim)
        return evicted

    def read(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """Loader thread: the block's data (checked: shared/kv_block_file.py), or None when its file is corrupt or
        missing (then it leaves the index and take_removed reports it). A block evicted since it was found is
        still read if its file is there yet (every check passes or it is a miss)."""
        with self._lock:
            block = self.blocks.get(block_hash)
            if block is not None and block.token_ids == token_ids and block.data is not None:  # (not written yet)
                return block.data
        try:
            return read_block_file(self.path(block_hash), self.contract, block_hash, token_ids, self.dtype,
                                   self.shape)  # fmt: skip
        except (CorruptBlockFile, OSError) as e:
            if block is not None:
                log.warning("disk KV tier: block %s unreadable (a miss): %s", block_hash.hex(), e)
                self._drop(block_hash, block)
            return None

    def _drop(self, block_hash: BlockHash, block: TierBlock, write: bool = False) -> None:
        """Take a block whose file failed (to be read, or with write to be written) out of the index (if it is still
        that block) and delete its file."""
        with self._lock:
            self.num_failures += 1
            self.num_write_failures += write
            if self.blocks.get(block_hash) is not block:
                return
            self.order.remove(block_hash)
            self.num_bytes -= self.blocks.pop(block_hash).nbytes
            self._removed.append(block_hash)
        self._jobs.put((block_hash, None))

    def take_removed(self) -> list[BlockHash]:
        """The blocks that left the index off the engine thread since the last call (failed reads and writes)."""
        with self._lock:
            removed, self._removed = self._removed, []
            return removed

    def _write_loop(self) -> None:
        """Writer thread: (hash, block) writes the block's file unless it left the index meanwhile; (hash, None)
        deletes the file. None stops."""
        while (job := self._jobs.get()) is not None:
            block_hash, block = job
            try:
                if block is None:
                    self.path(block_hash).unlink(missing_ok=True)
                else:
                    self._write(block_hash, block)
            except Exception:  # (a bug must not stop the writer: the next jobs still run)
                log.exception("disk KV tier: job for block %s failed", block_hash.hex())
            finally:
                self._jobs.task_done()

    def _write(self, block_hash: BlockHash, block: TierBlock) -> None:
        with self._lock:
            if self.blocks.get(block_hash) is not block:
                return  # evicted before it was written
        header = BlockFileHeader(self.contract, block_hash, block.token_ids, str(self.dtype).removeprefix("torch."),
                                 self.shape)  # fmt: skip
        try:
            try:
                write_block_file(self.path(block_hash), header, block.data)
            except OSError as e:
                if not self._make_room_for_retry(e, block.nbytes):
                    raise
                write_block_file(self.path(block_hash), header, block.data)
        except OSError as e:
            log.warning("disk KV tier: cannot write block %s: %s", block_hash.hex(), e)
            self._drop(block_hash, block, write=True)
            return
        with self._lock:
            if self.blocks.get(block_hash) is block:
                block.data = None  # (reads come from the file now)
                return
        # evicted while it was written: its delete ran before the file existed
        self.path(block_hash).unlink(missing_ok=True)

    def _make_room_for_retry(self, error: OSError, nbytes: int) -> bool:
        """Writer thread, after a write failed: whether one more try may succeed. The directory deleted under the
        tier: made again. The filesystem full (its space shared with other files, or other instances): the tier's
        capacity drops to what it holds now, and its least recently used blocks are deleted to free twice the
        block's size (the others' files stay, the tier stops growing into them). Anything else: no retry."""
        if error.errno == errno.ENOENT and not self.directory.is_dir():
            log.warning("disk KV tier %s was deleted: made again", self.directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            return True
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            return False
        with self._lock:
            self.capacity_bytes = min(self.capacity_bytes, max(0, self.num_bytes - 2 * nbytes))
            evicted = self._evict_to(self.capacity_bytes)
            self._removed += evicted
        log.warning("disk KV tier %s: the filesystem is full; the tier now holds at most %.1f MB (%d blocks evicted)",
                    self.directory, self.capacity_bytes / 1e6, len(evicted))  # fmt: skip
        for victim in evicted:
            self.path(victim).unlink(missing_ok=True)
        return bool(evicted)

    def flush(self) -> None:
        """Wait until every write and delete asked for so far is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finish the writes asked for, stop the writer thread, and give the slot up."""
        self._jobs.put(None)
        self._writer.join(timeout=30)
        if self._slot_lock is not None:
            os.close(self._slot_lock)  # (closing the descriptor drops the lock)
            self._slot_lock = None
