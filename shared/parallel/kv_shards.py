"""A decode rank's record of the requests whose KV heads it expects (heterogeneous P/D, docs/parallelism.md): rank
0 tells it ExpectKV at reserve, ForgetKV when the request is freed first, and asks CheckKV before the request
decodes; its TransferKVShard server (services/kv_shards.py) writes each message's heads through write().

Fencing: rank 0's messages come over the pipe in order, so a ForgetKV is handled before any later StepInput that
could reuse the request's blocks; write() holds the lock while it writes, and ForgetKV takes it, so once forget()
returns no message of that request writes any more (it is refused as unknown).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from tandem.shared.errors import UnknownRequestError
from tandem.shared.kv_connector import KVBlocks, missing_kv, new_received, write_kv
from tandem.shared.parallel.messages import ExpectKV

EXPECT_WAIT_S = 5.0  # most a message waits for its ExpectKV (sent at reserve; a long step on this rank delays it)
FORGOTTEN_KEPT = 4096  # request ids forgotten lately, refused at once rather than waited for


class KVShardReceiver:
    """The requests a decode rank > 0 expects KV for, and what of it arrived. pool: the rank's KV pool
    [layers, 2, blocks, block_size, heads held, row]; kv_heads: the model's KV heads [start, end) it holds."""

    def __init__(self, pool: torch.Tensor, kv_heads: tuple[int, int]):
        self.pool, self.kv_heads = pool, kv_heads
        self._cond = threading.Condition()
        # request id -> (block table, kv_skip_blocks, received: new_received)
        self._expected: dict[str, tuple[list[int | None], int, torch.Tensor]] = {}
        self._forgotten: OrderedDict[str, None] = OrderedDict()

    def expect(self, message: ExpectKV) -> None:
        received = new_received(len(message.block_table), self.pool.shape[0], self.pool.shape[4])
        with self._cond:
            self._forgotten.pop(message.request_id, None)
            self._expected[message.request_id] = (message.block_table, message.kv_skip_blocks, received)
            self._cond.notify_all()

    def forget(self, request_id: str) -> None:
        """Nothing more is written for request_id (a message under way finishes first: the lock)."""
        with self._cond:
            self._expected.pop(request_id, None)
            self._forgotten[request_id] = None
            while len(self._forgotten) > FORGOTTEN_KEPT:
                self._forgotten.popitem(last=False)
            self._cond.notify_all()

    def check(self, request_id: str) -> str | None:
        """None when every layer of every held head of every block from kv_skip_blocks on arrived, else why
        not. The request is forgotten either way (CheckKV)."""
        with self._cond:
            entry = self._expected.get(request_id)
            error = f"request {request_id!r} is not expected here" if entry is None else missing_kv(entry[2], entry[1])
        self.forget(request_id)
        return error

    def write(self, request_id: str, kv: KVBlocks, wait_s: float | None = None) -> int:
        """Write a message's blocks (checked by services/kv_wire.py kv_from_message) into the pool; returns the
        blocks written. Waits up to wait_s (default EXPECT_WAIT_S) for the request's ExpectKV. UnknownRequestError
        for a request not expected (never reserved, or forgotten: its blocks may be another's now; refused at
        once); InvalidRequestError when the blocks, layers or heads overrun it."""
        wait_s = EXPECT_WAIT_S if wait_s is None else wait_s
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._expected or request_id in self._forgotten,
                                       timeout=wait_s) or request_id not in self._expected:  # fmt: skip
                raise UnknownRequestError(f"KV transfer refused: request {request_id!r} is not waiting for KV on "
                                          "this decode rank")  # fmt: skip
            block_table, skip, received = self._expected[request_id]
            return write_kv(self.pool, block_table, received, skip, kv, self.kv_heads[0])

    def __contains__(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._expected
