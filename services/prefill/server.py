"""Prefill service: chunked prefill batched across prompts; after each step the blocks it completed stream to
the target decode instance while the next chunk computes; the first token returns to the gateway at once.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time

import grpc

from services.kv_wire import kv_to_messages
from services.runtime import (
    GRPC_OPTIONS, UpstreamError, add_engine_args, engine_configs, engine_load, make_server, sampling_params_from_proto,
    serve_engine,
)  # fmt: skip
from shared.async_engine import AsyncEngine
from shared.engine import LLMEngine
from shared.request import FinishReason, Request
from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.model_config = engine.engine.model_config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._transfers: set[asyncio.Task] = set()

    def _decode_stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return decode_pb2_grpc.DecodeStub(self._channels[address])

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
        transfer_call = self._decode_stub(request.decode_address).TransferKV(_drain(outbox))
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


async def main_async(args) -> None:
    model_config, cache_config, scheduler_config = engine_configs(args)
    engine = LLMEngine(model_config, cache_config, scheduler_config, args.device, export_kv=True)
    async_engine = AsyncEngine(engine, asyncio.get_running_loop())
    server, port, health_servicer = make_server(args.port, args.host)
    servicer = PrefillServicer(async_engine)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    await serve_engine(server, port, health_servicer, args, "prefill", lambda: servicer.GetLoad(None, None))
    async_engine.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description="Prefill tier: chunked prefill + KV shipping",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_engine_args(parser, num_blocks=1024, max_num_batched_tokens=512)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(levelname)s %(message)s")
    asyncio.run(main_async(parser.parse_args(argv)))
