"""Prefill service: chunked prefill batched across prompts; after each step the blocks it completed stream to
the target decode instance while the next chunk computes; the first token returns to the gateway at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from services.kv_wire import kv_to_messages
from services.runtime import ChannelPool, UpstreamError, engine_load, engine_main, sampling_params_from_proto
from shared.async_engine import AsyncEngine
from shared.request import FinishReason, Request
from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.model_config = engine.engine.model_config
        self.channels = ChannelPool()
        self._transfers: set[asyncio.Task] = set()

    async def Prefill(self, request, context):
        start = time.perf_counter()
        if not request.request_id or not request.decode_address:
            raise ValueError("request_id and decode_address are required")
        # The prefill samples exactly one token; EOS, stop ids and max_tokens are the decode's decisions.
        params = dataclasses.replace(
            sampling_params_from_proto(request.sampling_params), max_tokens=1, stop_token_ids=(), ignore_eos=True
        )
        req = Request(request.request_id, list(request.prompt_token_ids), params)
        outbox: asyncio.Queue = asyncio.Queue()
        stream = await self.engine.add(self.engine.engine.add_request, req)
        transfer_call = decode_pb2_grpc.DecodeStub(self.channels.get(request.decode_address)).TransferKV(_drain(outbox))
        transfer = asyncio.ensure_future(transfer_call)
        first_token_id = None
        try:
            while (out := await stream.get()) is not None:
                if out.kv is not None:
                    for msg in kv_to_messages(req.request_id, out.kv, self.model_config):
                        outbox.put_nowait(msg)
                if out.finish_reason == FinishReason.ABORT:
                    raise RuntimeError(out.error or "prefill aborted")
                if out.new_token_ids:
                    first_token_id = out.new_token_ids[0]
            outbox.put_nowait(decode_pb2.KVBlocksMessage(request_id=req.request_id, first_token_id=first_token_id))
            outbox.put_nowait(None)
        except BaseException:
            transfer_call.cancel()  # the decode side sees the broken stream and frees its reservation
            self.engine.abort(req.request_id)
            log.info("request %s aborted during prefill", req.request_id)
            raise
        if transfer.done() and not transfer.cancelled() and transfer.exception() is not None:
            e = transfer.exception()  # e.g. the decode address is unreachable: the first token would be orphaned
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL
            raise UpstreamError(code, f"KV transfer to decode {request.decode_address} failed: {e}")
        self._transfers.add(transfer)  # finishes in the background: TTFT does not wait for the last KV bytes
        transfer.add_done_callback(self._transfer_done)
        return prefill_pb2.PrefillResponse(
            first_token_id=first_token_id,
            num_computed_tokens=len(req.prompt_token_ids),
            prefill_ms=(time.perf_counter() - start) * 1000,
        )

    def _transfer_done(self, task: asyncio.Task) -> None:
        self._transfers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("KV transfer failed: %s", task.exception())

    async def GetLoad(self, request, context):
        return await self.engine.call(engine_load, self.engine.engine)


async def _drain(outbox: asyncio.Queue):
    while (msg := await outbox.get()) is not None:
        yield msg


def main(argv=None) -> None:
    engine_main("prefill", "Prefill tier: chunked prefill + KV shipping", num_blocks=1024,
                max_num_batched_tokens=512, export_kv=True, argv=argv,
                add_servicer=lambda server, engine: prefill_pb2_grpc.add_PrefillServicer_to_server(
                    PrefillServicer(engine), server))  # fmt: skip
