"""The gateway's wait for a prefill while it watches the decode that reserved the prompt's blocks: a decode whose
lease on them ran out (services/decode/server.py) says so on its stream, and the gateway must hear it then, not
only once the (dead or stalled) prefill answers."""
from __future__ import annotations

import asyncio

import grpc

from tandem.shared.cluster_state.registry import InstanceInfo


class PrefillLostError(Exception):
    """The decode failed a reservation while its prefill had not answered: the prompt's KV stopped coming."""


class _Prefetched:
    """A decode call whose next message is already being read (a task): read() returns that one first."""

    def __init__(self, call, pending: asyncio.Task):
        self.call, self.pending = call, pending

    async def read(self):
        if self.pending is None:
            return await self.call.read()
        pending, self.pending = self.pending, None
        return await pending

    def cancel(self) -> bool:
        if self.pending is not None:
            self.pending.cancel()
        return self.call.cancel()


async def prefill_watching_decode(prefill_call, decode_call, prefill: InstanceInfo):
    """Await the prefill's reply while reading the decode's stream, which says nothing until the prompt's KV is
    complete, unless the decode fails the request first: its lease on the reserved blocks ran out because the
    KV stopped coming (services/decode/server.py). Returns (prefill reply, the decode call to read on, its
    message read meanwhile first); PrefillLostError in that case (the prefill call is cancelled); the prefill's
    own error as it is."""
    prefill_task = asyncio.ensure_future(prefill_call)
    watch = asyncio.ensure_future(decode_call.read())
    try:
        await asyncio.wait({prefill_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not prefill_task.done() and not watch.exception():
            reply = watch.result()  # (a decode that broke instead: the prefill's KV transfer fails, it tells)
            if reply is not grpc.aio.EOF and reply.error and not reply.error_is_invalid_request:
                prefill_call.cancel()
                raise PrefillLostError(f"prefill {prefill.instance_id} did not deliver the prompt's KV "
                                       f"({reply.error})")
        return await prefill_task, _Prefetched(decode_call, watch)
    except BaseException:
        prefill_task.cancel()
        watch.cancel()
        raise
