"""Decode service: reserves blocks, receives prompt KV from prefill, decodes in a continuous batch, streams tokens.

Thin by design: protobuf in -> AsyncEngine call -> protobuf out.
"""
from __future__ import annotations

import logging

from services.kv_wire import kv_from_message
from services.runtime import FINISH_TO_PROTO, engine_load, engine_main, sampling_params_from_proto
from shared.async_engine import AsyncEngine
from shared.engine import LLMEngine, RequestOutput
from shared.request import FinishReason, Request, RequestStatus
from tandem.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.model_config = engine.engine.model_config
        self.cache_config = engine.engine.cache_config

    async def Generate(self, request, context):
        req = Request(request.request_id, list(request.prompt_token_ids), sampling_params_from_proto(request.sampling_params))
        if not req.request_id:
            raise ValueError("request_id is required")
        stream = await self.engine.add(self.engine.engine.reserve, req)
        finished = False
        try:
            yield decode_pb2.DecodeResponse(reserved=True)
            while (out := await stream.get()) is not None:
                msg = decode_pb2.DecodeResponse(token_ids=out.new_token_ids, error=out.error or "")
                if out.finished:
                    msg.finish_reason = FINISH_TO_PROTO[out.finish_reason]
                    finished = True
                yield msg
        finally:
            if not finished:  # client cancelled or disconnected: free the blocks now
                self.engine.abort(req.request_id)
                log.info("request %s aborted: the gateway closed the stream", req.request_id)

    async def TransferKV(self, request_iterator, context):
        num_blocks = 0
        request_id = None
        try:
            async for msg in request_iterator:
                request_id = msg.request_id
                if msg.num_blocks:
                    kv = kv_from_message(msg, self.model_config, self.cache_config)
                    await self.engine.call(self.engine.engine.import_kv, msg.request_id, kv)
                    if msg.layer_end == self.model_config.num_hidden_layers:
                        num_blocks += msg.num_blocks
                if msg.HasField("first_token_id"):
                    out = await self.engine.call(self.engine.engine.finish_kv_import, msg.request_id, msg.first_token_id)
                    if out is not None:
                        self.engine.deliver([out])
                    return decode_pb2.TransferKVResponse(num_blocks_received=num_blocks)
            raise ValueError("KV stream ended without the first token")
        except BaseException as e:
            # A broken transfer fails the request here so the gateway hears of it and the blocks are freed.
            if request_id is not None:
                await self._fail(request_id, f"KV transfer failed: {e!r}")
            raise

    async def _fail(self, request_id: str, error: str) -> None:
        """Fail a request whose KV transfer broke; one already decoding (a stray repeat) is left alone."""
        aborted = await self.engine.call(_abort_if_waiting_for_kv, self.engine.engine, request_id)
        if aborted:
            self.engine.deliver([RequestOutput(request_id, [], FinishReason.ABORT, error)])

    async def GetLoad(self, request, context):
        return await self.engine.call(engine_load, self.engine.engine)


def _abort_if_waiting_for_kv(engine: LLMEngine, request_id: str) -> bool:
    request = engine.requests.get(request_id)
    return request is not None and request.status == RequestStatus.WAITING_FOR_KV and engine.abort_request(request_id)


def main(argv=None) -> None:
    engine_main("decode", "Decode tier: continuous batching over paged KV", num_blocks=2048,
                max_num_batched_tokens=256, argv=argv,
                add_servicer=lambda server, engine: decode_pb2_grpc.add_DecodeServicer_to_server(
                    DecodeServicer(engine), server))  # fmt: skip
