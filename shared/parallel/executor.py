"""Rank 0's side of a tensor-parallel instance (vLLM's MultiprocExecutor, reduced): start one process per rank
> 0 (python -m ParallelConfig.worker_module: shared/parallel/worker.py, or a service's services/tp_worker.py), host
the TCPStore they join, hand them WorkerInit, watch them, and stop them.

Lifecycle: a rank that exits while the instance runs is a failure: on_failure callbacks run (the service takes
the instance down: engine_main), and rank 0's next collective fails its step. The other ranks exit when rank 0
goes (their pipe closes, their collectives fail, and the kernel signals them: PR_SET_PDEATHSIG). close() sends
Shutdown and waits for them (killing any that outstay the wait).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Callable

import torch
import torch.distributed as dist

from tandem.shared.config import CacheConfig, ModelConfig, ParallelConfig
from tandem.shared.parallel.group import TensorParallelGroup, make_backend
from tandem.shared.parallel.messages import Shutdown, WorkerInit

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(minutes=5)  # for every rank to start (import torch, connect)
STOP_TIMEOUT_S = 10.0


class TensorParallelWorkers:
    """The processes of ranks 1..size-1 and rank 0's TensorParallelGroup (.group). Build with start()."""

    def __init__(self, group: TensorParallelGroup, procs: list[subprocess.Popen]):
        self.group, self.procs = group, procs
        self.closing = False
        self.failure: str | None = None  # why the instance failed (a rank exited), once it did
        self._on_failure: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True).start()

    @classmethod
    def start(cls, model_config: ModelConfig, cache_config: CacheConfig, device: str,
              parallel_config: ParallelConfig) -> TensorParallelWorkers:
        """Start ranks 1..size-1, join them (rank 0 here) and send each its WorkerInit. RuntimeError if a rank
        exits while starting."""
        size = parallel_config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        procs, pipes = [], []
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                argv = [sys.executable, "-P", "-m", parallel_config.worker_module, "--rank", str(rank),
                        "--size", str(size), "--store-port", str(store.port), "--pipe-fd", str(theirs.fileno()),
                        "--threads", str(parallel_config.threads),
                        "--kernel-threads", str(parallel_config.kernel_threads),
                        "--device", torch.device(device).type]
                procs.append(subprocess.Popen(argv, pass_fds=(theirs.fileno(),)))
                theirs.close()
                pipes.append(Connection(ours.detach()))
            _wait_joined(store, procs)
            backend = make_backend(store, 0, size, torch.device(device))
            group = TensorParallelGroup(0, size, backend, pipes)
            group.send(WorkerInit(model_config, cache_config))
        except BaseException:
            for proc in procs:
                proc.kill()
            _stop(procs, STOP_TIMEOUT_S)
            raise
        log.info("tensor parallel: %d ranks joined (pids %s)", size, [os.getpid()] + [p.pid for p in procs])
        workers = cls(group, procs)
        workers.store = store  # (kept alive with the group; the KV transfer reports outcomes through it)
        return workers

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """callback(reason) runs (on a watcher thread) once a rank exits while the instance runs; at once if one
        did already."""
        with self._lock:
            self._on_failure.append(callback)
            failure = self.failure
        if failure is not None:
            callback(failure)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            if self.closing or self.failure is not None:
                return
            self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            callbacks = list(self._on_failure)
        log.error("%s: the instance cannot compute any more", self.failure)
        for callback in callbacks:
            callback(self.failure)

    def close(self) -> None:
        """Stop every rank: Shutdown, then a wait of STOP_TIMEOUT_S, then SIGKILL for any left."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
        try:
            self.group.send(Shutdown())
        except OSError:  # (a rank already gone)
            pass
        _stop(self.procs, STOP_TIMEOUT_S)
        self.group.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _wait_joined(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    """Until every rank > 0 has written joined/<rank> (it then builds its backend, which rank 0's completes);
    RuntimeError naming a rank that exits first, or after JOIN_TIMEOUT."""
    keys = [f"joined/{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (code {proc.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT}")
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
