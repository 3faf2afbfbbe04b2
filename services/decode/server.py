"""Decode service: reserves blocks, receives prompt KV from prefill, decodes in a continuous batch, streams tokens.

Thin by design: protobuf in -> AsyncEngine call -> protobuf out.
"""
from __future__ import annotations

import asyncio
import logging
import time

from tandem.services.convert import FINISH_TO_PROTO, logprobs_to_proto, sampling_params_from_proto
from tandem.services.engine_main import engine_main
from tandem.services.flags import DEFAULT_KV_LEASE_S
from tandem.services.grpc_errors import status_for
from tandem.services.kv_shards import start_kv_transfer
from tandem.services.kv_wire import KVTransferTally, kv_from_message
from tandem.services.metrics import EngineMetrics
from tandem.services.tracing import annotate
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.errors import InvalidRequestError
from tandem.shared.parallel.kv_heads import kv_head_range
from tandem.shared.request import Request
from tandem.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)
LEASE_CHECK_S = 0.5


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: AsyncEngine, instance_id: str, metrics: EngineMetrics | None = None,
                 kv_lease_s: float = DEFAULT_KV_LEASE_S):
        self.engine = engine
        self.instance_id = instance_id
        self.metrics = metrics
        self.kv_lease_s = kv_lease_s
        self._kv_progress: dict[str, float] = {}  # reserved request id -> when its KV last made progress
        self._transfers: set[str] = set()  # request ids whose TransferKV call is under way
        workers = engine.tp_workers
        # the model's KV heads this rank holds (tensor parallelism: the other ranks receive theirs themselves)
        self.kv_heads = kv_head_range(0, workers.group.size if workers is not None else 1,
                                      engine.model_config.num_key_value_heads)
        self.kv_rank_endpoints: list[str] = []  # ranks 1..'s TransferKVShard endpoints (services/kv_shards.py)

    async def Generate(self, request, context):
        if not request.request_id:
            raise InvalidRequestError("request_id is required")
        # (prompt logprobs come from the prefill, which computes the whole prompt; nothing here scores it again)
        params = sampling_params_from_proto(request.sampling_params, prompt_logprobs=None)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        req = Request(request.request_id, list(request.prompt_token_ids), params, cache_salt=salt,
                      priority=request.priority, output_token_ids=list(request.output_token_ids),
                      lora_name=request.lora_name if request.HasField("lora_name") else None)
        if request.compute_prompt:  # (conditional disaggregation: no prefill; the prompt is computed here)
            stream = await self.engine.add_request(req)
        else:
            stream = await self.engine.reserve(req)
            self._kv_progress[req.request_id] = time.monotonic()
        finished = False
        try:
            # (req.num_cached_tokens was set on the engine thread before reserve returned)
            yield decode_pb2.DecodeResponse(reserved=True, num_cached_tokens=req.num_cached_tokens or 0,
                                            num_skip_blocks=req.kv_skip_blocks)
            out = await (stream.get() if request.compute_prompt else self._first_under_lease(req.request_id, stream,
                                                                                            context))  # fmt: skip
            kv_lost = not request.compute_prompt and out is not None and bool(out.error)  # (its import failed)
            while out is not None:
                msg = decode_pb2.DecodeResponse(token_ids=out.new_token_ids, error=out.error or "",
                                                error_is_invalid_request=out.error_is_invalid_request,
                                                error_is_unavailable=kv_lost and not out.error_is_invalid_request,
                                                num_cached_tokens=req.num_cached_tokens or 0,
                                                num_cached_tokens_host=req.num_tier_cached_tokens.get("host", 0),
                                                num_cached_tokens_disk=req.num_tier_cached_tokens.get("disk", 0),
                                                num_draft_tokens=out.num_draft_tokens,
                                                num_accepted_tokens=out.num_accepted_tokens,
                                                logprobs=[logprobs_to_proto(lp) for lp in out.logprobs or ()])  # fmt: skip
                if out.finished:
                    msg.finish_reason = FINISH_TO_PROTO[out.finish_reason]
                    finished = True
                yield msg
                out = await stream.get()
        finally:
            self._kv_progress.pop(req.request_id, None)
            if not finished:  # client cancelled or disconnected: free the blocks now
                self.engine.abort(req.request_id)
                log.info("request %s aborted: its call ended first (the gateway closed it, or a drain timed out)",
                         req.request_id)

    async def _first_under_lease(self, request_id: str, stream: asyncio.Queue, context):
        """The reserved request's first output (once its KV is complete). Meanwhile, when no KV has arrived for
        kv_lease_s (or the call's deadline passed), the request is failed, its blocks freed: a prefill that died
        or stalls must not hold them, and the gateway, reading this stream, places the request again."""
        while True:
            try:
                return await asyncio.wait_for(stream.get(), LEASE_CHECK_S)
            except asyncio.TimeoutError:
                idle_s = time.monotonic() - self._kv_progress.get(request_id, time.monotonic())
                left = context.time_remaining()
                if idle_s > self.kv_lease_s or (left is not None and left <= 0):
                    await self.engine.fail_kv_import(request_id, f"its prompt KV stopped arriving for {idle_s:.0f} "
                                                                 "s (the prefill died or stalls): blocks freed")

    def busy(self) -> bool:
        """False: every request here lives in a Generate call, which a drain waits for."""
        return False

    async def TransferKV(self, request_iterator, context):
        """Prefill -> decode: one request's prompt KV (services/kv_wire.py). Each data message is checked (model,
        dtype, shape, checksum, block and layer range against the reservation) and written at once; the last one
        (first_token_id) states the totals sent, which must equal what arrived, and every layer of every block the
        request lacked must have come (KVConnector.finish_kv_import) before it joins the batch. A refused transfer
        fails the request (blocks freed; its Generate stream carries the reason) and answers INVALID_ARGUMENT;
        an unknown request id answers NOT_FOUND; a second transfer for a request whose transfer is under way
        (or done) is refused with INVALID_ARGUMENT and leaves that request alone."""
        tally: KVTransferTally | None = None
        owner = False  # this call is the request's transfer (not a concurrent repeat): its failure fails it
        try:
            async for msg in request_iterator:
                if tally is None:
                    tally = KVTransferTally(msg.request_id, self.engine.model_config.num_hidden_layers)
                    if msg.request_id in self._transfers:
                        raise InvalidRequestError(f"KV transfer refused: request {msg.request_id!r} already has one "
                                                  "under way")  # fmt: skip
                    self._transfers.add(msg.request_id)
                    owner = True
                tally.add(msg)
                if owner and msg.request_id in self._kv_progress:  # (renews the reservation's lease; keepalives too)
                    self._kv_progress[msg.request_id] = time.monotonic()
                await self._import(msg)
                if msg.HasField("first_token_id"):
                    tally.check_totals(msg)
                    await self.engine.finish_kv_import(msg.request_id, msg.first_token_id)
                    annotate(blocks_received=tally.num_blocks)
                    return decode_pb2.TransferKVResponse(num_blocks_received=tally.num_blocks)
            raise InvalidRequestError("KV transfer incomplete: the stream ended without the last message "
                                      "(first_token_id)")  # fmt: skip
        except BaseException as e:
            # A broken transfer fails the request here so the gateway hears of it and the blocks are freed; one
            # already decoding (a stray repeat) is left alone.
            if owner:
                reason = status_for(e, "decode", self.instance_id)[1] if isinstance(e, Exception) else "cancelled"
                error = reason if reason.startswith("KV transfer") else f"KV transfer failed: {reason}"
                log.warning("request %s: %s", tally.request_id, error)
                await self.engine.fail_kv_import(tally.request_id, error)
            raise
        finally:
            if owner:
                self._transfers.discard(tally.request_id)

    async def _import(self, msg) -> None:
        """A data message of either stream (none for a keepalive or a last message): checked against this rank
        (services/kv_wire.py kv_from_message) and written into the request's reserved blocks."""
        if not (msg.num_blocks or msg.data):
            return
        if self.metrics is not None:
            self.metrics.observe_kv_message("any", msg.ByteSize())
        if not msg.num_blocks:
            raise InvalidRequestError(f"KV transfer refused: num_blocks is 0 but data has {len(msg.data)} bytes")
        kv = kv_from_message(msg, self.engine.model_config, self.engine.cache_config, self.kv_heads)
        await self.engine.import_kv(msg.request_id, kv)

    async def TransferKVShard(self, request_iterator, context):
        """One prefill rank's KV heads for this rank (tensor parallelism on either tier; docs/parallelism.md):
        data messages checked as TransferKV's (their heads must be this rank's: INVALID_ARGUMENT naming
        kv_head_start) and written at once, then the totals. The request must be reserved and waiting for its KV
        (NOT_FOUND otherwise). A failure ends this stream only: the prefill then fails its call and breaks the
        control stream (TransferKV), which fails the request."""
        tally = None
        async for msg in request_iterator:
            tally = tally or KVTransferTally(msg.request_id, self.engine.model_config.num_hidden_layers)
            tally.add(msg)
            if msg.request_id in self._kv_progress:  # (renews the reservation's lease)
                self._kv_progress[msg.request_id] = time.monotonic()
            await self._import(msg)
            if msg.HasField("num_messages_sent"):
                tally.check_totals(msg)
                return decode_pb2.TransferKVResponse(num_blocks_received=tally.num_blocks)
        raise InvalidRequestError("KV transfer incomplete: the shard stream ended without its last message "
                                  "(num_messages_sent)")  # fmt: skip


def _add_servicer(server, engine: AsyncEngine, metrics: EngineMetrics, args) -> DecodeServicer:
    servicer = DecodeServicer(engine, server.instance_id, metrics, args.kv_lease_timeout)
    servicer.kv_rank_endpoints = start_kv_transfer(engine, "decode", args)
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server.grpc)
    return servicer


def main(argv=None) -> None:
    engine_main("decode", "Decode tier: continuous batching over paged KV", _add_servicer, argv=argv)
