"""Prefill service: chunked prefill batched across prompts; after each step the blocks it completed stream to
the target decode instance while the next chunk computes; the first token returns to the gateway at once.
Embed runs prefill-only work: pooling requests (embeddings), with no decode and no KV shipped.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tandem.services.channels import ChannelPool
from tandem.services.convert import logprobs_to_proto, sampling_params_from_proto
from tandem.services.engine_main import engine_main
from tandem.services.grpc_errors import upstream_error
from tandem.services.kv_wire import kv_to_messages, last_message
from tandem.services.metrics import EngineMetrics
from tandem.services.tracing import annotate, bind_request, end_when_done, start_span, traced, use_span
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.errors import InvalidRequestError, RequestFailedError
from tandem.shared.request import FinishReason, PoolingParams, Request, SamplingParams
from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
KV_KEEPALIVE_S = 0.5  # most seconds between two messages of a transfer (the decode's --kv-lease-timeout is >= 2)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics | None = None,
                 channels: ChannelPool | None = None):
        self.engine, self.metrics = engine, metrics
        self.channels = channels or ChannelPool()  # (to the decodes; with the service's TLS settings)
        self._transfers: set[asyncio.Task] = set()

    @traced("prefill")
    async def Prefill(self, request, context):
        start = time.perf_counter()
        if not request.request_id or not request.decode_address:
            raise InvalidRequestError("request_id and decode_address are required")
        decode_id = request.decode_instance_id or "instance"
        # The prefill samples exactly one token, with the request's own parameters (min_tokens, penalties, seed,
        # logprobs mean here what they mean on the decode); whether it ends the request is the decode's decision.
        # A migrated request arrives with its output so far (output_token_ids): the token sampled comes after it.
        params = sampling_params_from_proto(request.sampling_params, max_tokens=len(request.output_token_ids) + 1)
        salt = request.cache_salt if request.HasField("cache_salt") else None
        req = Request(request.request_id, list(request.prompt_token_ids), params, cache_salt=salt,
                      priority=request.priority, output_token_ids=list(request.output_token_ids),
                      lora_name=request.lora_name if request.HasField("lora_name") else None)
        block_size = self.engine.cache_config.block_size
        if request.num_skip_blocks and request.num_skip_blocks > (req.num_tokens - 1) // block_size:
            raise InvalidRequestError(f"num_skip_blocks {request.num_skip_blocks} exceeds the prompt's full blocks "
                                      f"before its last token")  # fmt: skip
        req.kv_skip_blocks = request.num_skip_blocks
        outbox: asyncio.Queue = asyncio.Queue()
        stream = await self.engine.add_request(req)
        kv_span = start_span("kv_transfer", decode_instance_id=decode_id)  # (its call carries it to the decode)
        with use_span(kv_span):
            channel = self.channels.get(request.decode_address, request.decode_instance_id or None)
            transfer_call = decode_pb2_grpc.DecodeStub(channel).TransferKV(_drain(outbox, req.request_id))
        transfer = asyncio.ensure_future(transfer_call)
        end_when_done(kv_span, transfer)
        first_token_id = first_logprobs = None
        prompt_logprobs = []
        num_blocks_sent = num_bytes_sent = num_messages_sent = 0
        try:
            while (out := await stream.get()) is not None:
                if out.kv is not None:
                    num_blocks_sent += out.kv.data.shape[2]
                    num_bytes_sent += out.kv.data.nbytes
                    for msg in kv_to_messages(req.request_id, out.kv, self.engine.model_config,
                                              kv_dtype=self.engine.cache_config.kv_dtype):
                        outbox.put_nowait(msg)
                        num_messages_sent += 1
                        if self.metrics is not None:
                            self.metrics.observe_kv_message(decode_id, msg.ByteSize())
                if out.finish_reason == FinishReason.ABORT:
                    error = InvalidRequestError if out.error_is_invalid_request else RequestFailedError
                    raise error(f"prefill failed: {out.error or 'aborted'}")
                if out.new_token_ids:
                    first_token_id = out.new_token_ids[0]
                    first_logprobs = out.logprobs[0] if out.logprobs else None
                    prompt_logprobs = out.prompt_logprobs or []
            if first_token_id is None:  # (the engine always samples one; never send a last message without it)
                raise RequestFailedError("prefill failed: the prompt ended without a first token")
            outbox.put_nowait(last_message(req.request_id, first_token_id, num_messages_sent, num_blocks_sent))
            outbox.put_nowait(None)
            annotate(kv_span, blocks_sent=num_blocks_sent, bytes_sent=num_bytes_sent)
        except BaseException:
            transfer_call.cancel()  # the decode side sees the broken stream and frees its reservation
            self.engine.abort(req.request_id)
            log.info("request %s aborted during prefill", req.request_id)
            raise
        if transfer.done() and not transfer.cancelled() and transfer.exception() is not None:
            e = transfer.exception()  # e.g. the decode is unreachable: the first token would be orphaned
            if isinstance(e, grpc.aio.AioRpcError):
                raise upstream_error(e, "decode", decode_id, "receiving KV")
            raise e
        self._transfers.add(transfer)  # finishes in the background: TTFT does not wait for the last KV bytes
        transfer.add_done_callback(lambda task: self._transfer_done(task, req.request_id, decode_id, num_blocks_sent,
                                                                    start))  # fmt: skip
        bind_request(req.request_id, prompt_tokens=len(req.prompt_token_ids), cached_tokens=req.num_cached_tokens or 0)
        prefill_ms = (time.perf_counter() - start) * 1000
        return prefill_pb2.PrefillResponse(first_token_id=first_token_id, prefill_ms=prefill_ms,
                                           num_cached_tokens=req.num_cached_tokens or 0,
                                           num_cached_tokens_host=req.num_tier_cached_tokens.get("host", 0),
                                           num_cached_tokens_disk=req.num_tier_cached_tokens.get("disk", 0),
                                           num_blocks_sent=num_blocks_sent, queue_ms=(req.queue_time_s or 0.0) * 1000,
                                           first_token_logprobs=first_logprobs and logprobs_to_proto(first_logprobs),
                                           prompt_logprobs=[logprobs_to_proto(lp) for lp in prompt_logprobs])

    @traced("embed")
    async def Embed(self, request, context):
        """Each input as a pooling request (PoolingParams: last-token pooling, L2-normalized), all admitted at
        once so the engine batches them; every one is aborted if one fails or the call is cancelled."""
        start = time.perf_counter()
        if not request.request_id or not request.inputs:
            raise InvalidRequestError("request_id and inputs are required")
        params = SamplingParams(max_tokens=1, speculative=False)  # (nothing is sampled)
        reqs = [Request(f"{request.request_id}-{i}", list(x.token_ids), params, priority=request.priority,
                        pooling_params=PoolingParams()) for i, x in enumerate(request.inputs)]  # fmt: skip
        embeddings = []
        try:
            streams = [await self.engine.add_request(req) for req in reqs]
            for req, stream in zip(reqs, streams):
                while (out := await stream.get()) is not None:
                    if out.finish_reason == FinishReason.ABORT:
                        error = InvalidRequestError if out.error_is_invalid_request else RequestFailedError
                        raise error(f"embedding failed: {out.error or 'aborted'}")
                    if out.pooled is not None:
                        embeddings.append(prefill_pb2.Embedding(values=out.pooled.tolist()))
        except BaseException:
            for req in reqs:
                self.engine.abort(req.request_id)
            raise
        return prefill_pb2.EmbedResponse(embeddings=embeddings, embed_ms=(time.perf_counter() - start) * 1000,
                                         num_cached_tokens=sum(r.num_cached_tokens or 0 for r in reqs))

    def busy(self) -> bool:
        """True while KV still streams to a decode after its Prefill call returned (a drain waits for it)."""
        return bool(self._transfers)

    def _transfer_done(self, task: asyncio.Task, request_id: str, decode_id: str, num_blocks_sent: int,
                       start: float) -> None:
        self._transfers.discard(task)
        if task.cancelled():
            return
        if self.metrics is not None and task.exception() is None:
            self.metrics.kv_transfer_duration.labels(**self.metrics.labels, peer=decode_id).observe(
                time.perf_counter() - start)
        if task.exception() is not None:  # (the decode failed the request itself: its Generate stream says why)
            log.warning("request %s: KV transfer to decode %s failed: %s", request_id, decode_id, task.exception())
        elif task.result().num_blocks_received != num_blocks_sent:
            # NOTE: cannot happen between tiers of this version: the decode checks the last message's totals (and
            # that every layer of every block it lacked came) before it acknowledges, and fails the request
            # otherwise. The first token went to the gateway already, so there is nothing left to fail here: a
            # mismatch means the tiers disagree on the protocol (a version skew or a bug), logged as such.
            log.error("request %s: protocol violation: decode %s acknowledged %d KV blocks, %d were sent", request_id,
                      decode_id, task.result().num_blocks_received, num_blocks_sent)  # fmt: skip


async def _drain(outbox: asyncio.Queue, request_id: str):
    """The TransferKV stream: outbox's messages until None. While none comes for KV_KEEPALIVE_S (the prompt is
    queued behind others, or a long chunk computes), an empty message naming the request renews the decode's
    lease on its reservation: only a prefill that died or froze goes silent."""
    get = None
    try:
        while True:
            get = get or asyncio.ensure_future(outbox.get())
            done, _ = await asyncio.wait({get}, timeout=KV_KEEPALIVE_S)
            if not done:
                yield decode_pb2.KVBlocksMessage(request_id=request_id)
                continue
            msg, get = get.result(), None
            if msg is None:
                return
            yield msg
    finally:
        if get is not None:
            get.cancel()


def _add_servicer(server, engine: AsyncEngine, metrics: EngineMetrics, args) -> PrefillServicer:
    servicer = PrefillServicer(engine, metrics, ChannelPool(args.tls))
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server.grpc)
    return servicer


def main(argv=None) -> None:
    engine_main("prefill", "Prefill tier: chunked prefill + KV shipping", _add_servicer, export_kv=True, argv=argv)
