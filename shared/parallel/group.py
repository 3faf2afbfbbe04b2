"""The process group of one instance's ranks (vLLM's parallel_state, reduced to what tensor parallelism needs):
a TCPStore that rank 0 hosts, a torch.distributed backend over it (gloo on CPU, NCCL on CUDA) for the model's
collectives, and a pipe per rank > 0 that carries rank 0's typed messages (shared/parallel/messages.py).

The backend object is held here, not registered as torch.distributed's default group: no module-global state,
so a process (a test) may build and close several tensor-parallel engines one after another.
"""
from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tandem.shared.parallel.messages import decode, encode

# A rank that stops answering inside a step fails the step after this long (a dead one fails it at once: its
# connections close). Idle ranks wait on their pipe, not in a collective, so an idle instance never times out.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def make_backend(store: dist.Store, rank: int, size: int, device: torch.device):
    """gloo (bound to 127.0.0.1: the ranks of an instance share one host) on CPU, NCCL on CUDA."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, size, options)


class TensorParallelGroup:
    """One rank's view of its instance: rank in [0, size), the backend, and its message pipes (rank 0: one to each
    other rank, index rank - 1; a rank > 0: the one from rank 0)."""

    def __init__(self, rank: int, size: int, backend, pipes: list[Connection]):
        self.rank, self.size, self.backend, self.pipes = rank, size, backend, pipes

    # -- messages (rank 0 -> the others) -------------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: send one typed message to every other rank (BrokenPipeError if one is gone)."""
        data = encode(message)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def recv(self):
        """A rank > 0: the next message from rank 0 (EOFError once rank 0 is gone)."""
        return decode(self.pipes[0].recv_bytes())

    def ask(self, message) -> list:
        """Rank 0: send message to every other rank and return their answers, in rank order (each rank answers
        with reply; EOFError if one is gone). Only on the thread that sends the steps."""
        self.send(message)
        return [decode(pipe.recv_bytes()) for pipe in self.pipes]

    def reply(self, answer) -> None:
        """A rank > 0: answer rank 0's last ask (a plain value: str, None, ...)."""
        self.pipes[0].send_bytes(encode(answer))

    def broadcast(self, message):
        """Rank 0 sends message and returns it; the others return what rank 0 sent."""
        if self.rank == 0:
            self.send(message)
            return message
        return self.recv()

    # -- collectives (every rank, in the same order) -------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x contiguous). RuntimeError when a rank is gone."""
        self.backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [..., n] (the same shape on each) concatenated along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()
        self.backend = None
