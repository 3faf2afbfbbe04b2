"""The process of a tensor-parallel rank > 0 (started by rank 0: shared/parallel/executor.py): join the group,
build a ModelRunner on this rank's shards and KV pool from rank 0's WorkerInit, then run each StepInput rank 0
sends until Shutdown (exit 0) or until rank 0 is gone (its pipe closes or a collective fails: exit 1). Only rank 0
schedules, samples and owns the KV cache manager; this rank pages its KV heads by the same block ids. Between two
tiers it ships or receives its own KV heads, when its process was started with a kv_transfer (the services'
services/tp_worker.py: services/kv_shards.py, from rank 0's KVTransferInit on; gRPC lives there, not here).

    python -P -m tandem.shared.parallel.worker --rank R --size N --store-port P --pipe-fd FD --threads T
        --kernel-threads K --device cpu|cuda
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

log = logging.getLogger("tandem.shared.parallel.worker")


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL when the parent (rank 0) dies, however it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None, kv_transfer=None) -> int:
    """Run the rank; its exit code. kv_transfer(KVTransferInit, runner, rank, size, store): this rank's part of the
    KV transfer between tiers (.endpoint, .handle(message), .close()); None: a KVTransferInit is answered with
    why not."""
    parser = argparse.ArgumentParser(prog="python -m tandem.shared.parallel.worker")
    for name in ("--rank", "--size", "--store-port", "--pipe-fd", "--threads", "--kernel-threads"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    args = parser.parse_args(argv)
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # (rank 0 died before the line above)
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches rank 0, which drains and stops the ranks)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")

    import torch
    import torch.distributed as dist

    from tandem.kernels import cpu_ext
    from tandem.shared.model_runner import ModelRunner
    from tandem.shared.parallel.group import TensorParallelGroup, make_backend
    from tandem.shared.parallel.messages import CheckKV, KVTransferInit, Shutdown, StepInput, WorkerInit

    torch.set_num_threads(args.threads)
    pipe = Connection(args.pipe_fd)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, False, timeout=timedelta(minutes=5))
    store.set(f"joined/{args.rank}", "1")
    device = torch.device(f"cuda:{args.rank}" if args.device == "cuda" else "cpu")
    group = TensorParallelGroup(args.rank, args.size, make_backend(store, args.rank, args.size, device), [pipe])
    try:
        init = group.recv()
    except EOFError:
        return 1
    assert isinstance(init, WorkerInit), init
    runner = ModelRunner(init.model_config, init.cache_config, str(device), tp=group)
    if device.type == "cpu":
        cpu_ext.set_num_threads(args.kernel_threads)
    kv = None  # this rank's part of the KV transfer between tiers (services/kv_shards.py), once rank 0 starts it
    while True:
        try:
            message = group.recv()
        except (EOFError, OSError):
            log.error("rank 0 is gone: exiting")
            return 1
        if isinstance(message, Shutdown):
            if kv is not None:
                kv.close()
            return 0
        if isinstance(message, KVTransferInit):
            try:
                if kv_transfer is None:
                    raise RuntimeError("this rank's process has no KV transfer (start it as tandem.services.tp_worker)")
                kv = kv_transfer(message, runner, args.rank, args.size, store)
                group.reply((kv.endpoint, None))
            except (ValueError, RuntimeError, OSError) as e:  # (rank 0 says why and stops the instance)
                group.reply(("", str(e)))
            continue
        if not isinstance(message, StepInput):  # (a KV message: ExpectKV, ForgetKV, CheckKV, ExportKV, CancelKV)
            answer = kv.handle(message) if kv is not None else "this rank receives no KV (no KVTransferInit)"
            if isinstance(message, CheckKV):
                group.reply(answer)
            continue
        try:
            runner.run_step(message)
        except RuntimeError as e:  # a collective failed: another rank is gone
            log.error("step failed (%s): exiting", e)
            return 1


if __name__ == "__main__":
    sys.exit(main())
