"""Prefill service: chunked prefill batched across prompts; after each step the blocks it completed stream to
the target decode instance while the next chunk computes; the first token returns to the gateway at once.
Embed runs prefill-only work: pooling requests (embeddings), with no decode and no KV shipped.

Tensor parallelism on either tier (docs/parallelism.md): each prefill rank ships the KV heads it is the lowest
holder of straight to each decode rank holding them (shared/parallel/kv_heads.py kv_transfer_routes); this rank's
go on TransferKV to decode rank 0 (the control stream) and on TransferKVShard streams to the other decode ranks,
the other ranks' from their own processes (services/kv_shards.py). The control stream's last message (the first
token and its totals) goes only once every shard stream was acknowledged; a failed one fails the call
(UNAVAILABLE, naming the decode), and the gateway places the request again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from tandem.services.channels import ChannelPool
from tandem.services.convert import logprobs_to_proto, sampling_params_from_proto
from tandem.services.engine_main import engine_main
from tandem.services.grpc_errors import upstream_error
from tandem.services.kv_shards import start_kv_transfer
from tandem.services.kv_wire import kv_to_messages, last_message
from tandem.services.metrics import EngineMetrics
from tandem.services.tracing import annotate, bind_request, end_when_done, start_span, traced, use_span
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.errors import InvalidRequestError, RequestFailedError, UpstreamError
from tandem.shared.kv_connector import KVBlocks
from tandem.shared.parallel.kv_heads import KVRoute, kv_head_range, kv_transfer_routes
from tandem.shared.parallel.messages import KVDestination, kv_outcome_key
from tandem.shared.request import FinishReason, PoolingParams, Request, SamplingParams
from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
KV_KEEPALIVE_S = 0.5  # most seconds between two messages of a transfer (the decode's --kv-lease-timeout is >= 2)
# how often rank 0 looks for its other ranks' shard stream outcomes (the instance's TCPStore; each look is a loopback
# round trip on the event loop): from the first value, doubling up to the second while none comes
SHARD_POLL_S = (0.001, 0.004)
SHARD_FORGET_S = 60.0  # how long a failed or cancelled transfer's outcomes are looked for, to delete them


class _Outbox:
    """One outgoing stream of a transfer (rank 0's): the messages queued for it and the totals sent so far."""

    def __init__(self, route: KVRoute):
        self.route, self.queue = route, asyncio.Queue()
        self.num_messages = self.num_blocks = 0


class _Transfer:
    """One request's KV transfer from rank 0: its streams (outboxes[0] is the control stream, to decode rank 0's
    TransferKV; the rest go to TransferKVShard), the routes of every rank (the others report through the store
    under serial) and what the prompt's steps gave: the totals sent and the first token."""

    def __init__(self, routes: list[KVRoute], endpoints: list[str], serial: int, decode_id: str):
        self.routes, self.endpoints, self.serial, self.decode_id = routes, endpoints, serial, decode_id
        self.outboxes = [_Outbox(r) for r in routes if r.prefill_rank == 0]  # decode rank 0's first
        self.control = self.outboxes[0]
        self.control_call: asyncio.Future | None = None
        self.shard_calls: list[asyncio.Future] = []
        self.num_blocks_sent = self.num_bytes_sent = 0
        self.first_token_id: int | None = None
        self.first_logprobs = None
        self.prompt_logprobs = []

    def cancel(self) -> None:
        """Break every stream: the decode ranks see it and free the request's reservation."""
        for call in [self.control_call, *self.shard_calls]:
            if call is not None:
                call.cancel()


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine: AsyncEngine, metrics: EngineMetrics | None = None,
                 channels: ChannelPool | None = None):
        self.engine, self.metrics = engine, metrics
        self.channels = channels or ChannelPool()  # (to the decodes; with the service's TLS settings)
        self._transfers: set[asyncio.Task] = set()
        workers = engine.tp_workers
        self.tp_size = workers.group.size if workers is not None else 1
        self.store = workers.store if workers is not None else None  # (the other ranks' shard outcomes)
        self._serials = itertools.count(1)  # (names each transfer in the store)
        self._forgetting: set[asyncio.Task] = set()

    @traced("prefill")
    async def Prefill(self, request, context):
        """Compute the prompt, stream its KV to the decode while it computes, and answer the first token once the
        decode holds every block (the control stream's last message goes after every shard stream's
        acknowledgement; the control stream's own acknowledgement comes in the background)."""
        start = time.perf_counter()
        req = self._new_request(request)
        routes, endpoints = self._routes(request)
        transfer = _Transfer(routes, endpoints, next(self._serials), request.decode_instance_id or "instance")
        if self.tp_size > 1:  # (the other ranks ship their own heads)
            req.kv_destination = KVDestination(transfer.serial, transfer.decode_id, len(endpoints), endpoints)
        stream = await self.engine.add_request(req)
        kv_span = self._open_streams(transfer, request, req.request_id)
        try:
            await self._pump(stream, req.request_id, transfer)
            await self._finish(transfer, req.request_id)
            annotate(kv_span, blocks_sent=transfer.num_blocks_sent, bytes_sent=transfer.num_bytes_sent)
        except BaseException:
            transfer.cancel()
            self.engine.abort(req.request_id)  # (its ranks' streams are cancelled: CancelKV)
            self._forget_outcomes(transfer.serial, routes)
            log.info("request %s aborted during prefill", req.request_id)
            raise
        control = transfer.control_call
        if control.done() and not control.cancelled() and control.exception() is not None:
            e = control.exception()  # e.g. the decode is unreachable: the first token would be orphaned
            if isinstance(e, grpc.aio.AioRpcError):
                raise upstream_error(e, "decode", transfer.decode_id, "receiving KV")
            raise e
        self._transfers.add(control)  # finishes in the background: TTFT does not wait for the last KV bytes
        control.add_done_callback(lambda task: self._transfer_done(task, req.request_id, transfer.decode_id,
                                                                   transfer.control.num_blocks, start))  # fmt: skip
        bind_request(req.request_id, prompt_tokens=len(req.prompt_token_ids), cached_tokens=req.num_cached_tokens or 0)
        return prefill_pb2.PrefillResponse(first_token_id=transfer.first_token_id,
                                           prefill_ms=(time.perf_counter() - start) * 1000,
                                           num_cached_tokens=req.num_cached_tokens or 0,
                                           num_cached_tokens_host=req.num_tier_cached_tokens.get("host", 0),
                                           num_cached_tokens_disk=req.num_tier_cached_tokens.get("disk", 0),
                                           num_blocks_sent=transfer.num_blocks_sent,
                                           queue_ms=(req.queue_time_s or 0.0) * 1000,
                                           first_token_logprobs=transfer.first_logprobs and
                                           logprobs_to_proto(transfer.first_logprobs),
                                           prompt_logprobs=[logprobs_to_proto(lp) for lp in transfer.prompt_logprobs])

    def _new_request(self, request) -> Request:
        """The engine Request of a PrefillRequest. InvalidRequestError naming the field that is missing or out of
        range."""
        if not request.request_id or not request.decode_address:
            raise InvalidRequestError("request_id and decode_address are required")
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
        return req

    def _open_streams(self, transfer: _Transfer, request, request_id: str):
        """Start rank 0's streams to the decode ranks (each sends its outbox's messages as they come); returns
        the kv_transfer span, which the control call carries to the decode and which ends with it."""
        kv_span = start_span("kv_transfer", decode_instance_id=transfer.decode_id)
        with use_span(kv_span):
            channel = self.channels.get(request.decode_address, request.decode_instance_id or None)
            control = decode_pb2_grpc.DecodeStub(channel).TransferKV(_drain(transfer.control.queue, request_id))
            shards = [decode_pb2_grpc.DecodeStub(self.channels.get(transfer.endpoints[box.route.decode_rank]))
                      .TransferKVShard(_drain(box.queue, request_id)) for box in transfer.outboxes[1:]]  # fmt: skip
        transfer.control_call = asyncio.ensure_future(control)
        transfer.shard_calls = [asyncio.ensure_future(call) for call in shards]
        end_when_done(kv_span, transfer.control_call)
        return kv_span

    async def _pump(self, stream, request_id: str, transfer: _Transfer) -> None:
        """The engine's outputs for the prompt until it ends: each step's blocks go onto the streams, the first
        token (and its logprobs) is kept. InvalidRequestError / RequestFailedError when the engine fails it."""
        while (out := await stream.get()) is not None:
            if out.kv is not None:
                transfer.num_blocks_sent += out.kv.data.shape[2]
                transfer.num_bytes_sent += out.kv.data.nbytes
                self._queue_kv(request_id, out.kv, transfer.outboxes, transfer.decode_id)
            if out.finish_reason == FinishReason.ABORT:
                error = InvalidRequestError if out.error_is_invalid_request else RequestFailedError
                raise error(f"prefill failed: {out.error or 'aborted'}")
            if out.new_token_ids:
                transfer.first_token_id = out.new_token_ids[0]
                transfer.first_logprobs = out.logprobs[0] if out.logprobs else None
                transfer.prompt_logprobs = out.prompt_logprobs or []
        if transfer.first_token_id is None:  # (the engine always samples one; never send a last message without it)
            raise RequestFailedError("prefill failed: the prompt ended without a first token")

    async def _finish(self, transfer: _Transfer, request_id: str) -> None:
        """End the shard streams, wait until every one was acknowledged (UpstreamError UNAVAILABLE if one was
        not), then send the control stream's last message: the first token and its totals."""
        for box in transfer.outboxes[1:]:
            box.queue.put_nowait(last_message(request_id, None, box.num_messages, box.num_blocks))
            box.queue.put_nowait(None)
        await self._shards_acknowledged(transfer)
        control = transfer.control
        control.queue.put_nowait(last_message(request_id, transfer.first_token_id, control.num_messages,
                                              control.num_blocks))  # fmt: skip
        control.queue.put_nowait(None)

    def _routes(self, request) -> tuple[list[KVRoute], list[str]]:
        """The transfer's streams (kv_transfer_routes from this instance's ranks to the decode's) and the decode
        ranks' KV endpoints (rank 0's: decode_address). InvalidRequestError naming the field when the decode's
        size and endpoints disagree or do not split the model's KV heads."""
        size = request.decode_tensor_parallel_size or 1
        endpoints = list(request.decode_kv_endpoints) if size > 1 else [request.decode_address]
        if len(endpoints) != size:
            raise InvalidRequestError(f"decode_kv_endpoints lists {len(endpoints)} endpoints for "
                                      f"decode_tensor_parallel_size {size}")  # fmt: skip
        try:
            return kv_transfer_routes(self.tp_size, size, self.engine.model_config.num_key_value_heads), endpoints
        except ValueError as e:
            raise InvalidRequestError(f"decode_tensor_parallel_size {size}: {e}") from None

    def _queue_kv(self, request_id: str, kv: KVBlocks, outboxes: list[_Outbox], decode_id: str) -> None:
        """A step's blocks of this rank's heads, as messages on each of rank 0's streams (its heads' slice)."""
        held = kv_head_range(0, self.tp_size, self.engine.model_config.num_key_value_heads)
        for box in outboxes:
            h0, h1 = box.route.head_start - held[0], box.route.head_end - held[0]
            part = kv if (h0, h1) == (0, kv.data.shape[4]) else KVBlocks(
                kv.first_block_index, kv.data[:, :, :, :, h0:h1], head_start=box.route.head_start)  # fmt: skip
            for msg in kv_to_messages(request_id, part, self.engine.model_config,
                                      kv_dtype=self.engine.cache_config.kv_dtype):
                box.queue.put_nowait(msg)
                box.num_messages += 1
                if self.metrics is not None:
                    self.metrics.observe_kv_message(decode_id, msg.ByteSize())
            box.num_blocks += kv.data.shape[2]

    async def _shards_acknowledged(self, transfer: _Transfer) -> None:
        """Wait until every shard stream of the transfer was acknowledged by its decode rank: rank 0's own
        (transfer.shard_calls) and the other ranks' (their outcomes in the TCPStore). UpstreamError UNAVAILABLE
        naming the decode when one failed."""
        decode_id = transfer.decode_id
        for box, call in zip(transfer.outboxes[1:], transfer.shard_calls):
            try:
                response = await call
            except grpc.aio.AioRpcError as e:
                raise _shard_failed(decode_id, 0, box.route.decode_rank, f"{e.code().name}: {e.details()}") from None
            if response.num_blocks_received != box.num_blocks:
                raise _shard_failed(decode_id, 0, box.route.decode_rank, f"acknowledged "
                                    f"{response.num_blocks_received} blocks, {box.num_blocks} were sent")
        pending = {kv_outcome_key(transfer.serial, r.prefill_rank, r.decode_rank): r
                   for r in transfer.routes if r.prefill_rank > 0}  # fmt: skip
        wait_s = SHARD_POLL_S[0]
        while pending:
            done = [k for k in pending if self.store.check([k])]
            for key in done:
                route, outcome = pending.pop(key), self.store.get(key).decode()
                self.store.delete_key(key)
                if outcome:
                    raise _shard_failed(decode_id, route.prefill_rank, route.decode_rank, outcome)
            if pending:
                wait_s = SHARD_POLL_S[0] if done else min(2 * wait_s, SHARD_POLL_S[1])
                await asyncio.sleep(wait_s)

    def _forget_outcomes(self, serial: int, routes: list[KVRoute]) -> None:
        """A transfer given up: delete its ranks' outcomes from the store as they come (in the background)."""
        keys = [kv_outcome_key(serial, r.prefill_rank, r.decode_rank) for r in routes if r.prefill_rank > 0]
        if not keys:
            return

        async def forget() -> None:
            deadline = time.monotonic() + SHARD_FORGET_S
            while keys and time.monotonic() < deadline:
                for key in [k for k in keys if self.store.check([k])]:
                    self.store.delete_key(key)
                    keys.remove(key)
                await asyncio.sleep(0.1)

        task = asyncio.ensure_future(forget())
        self._forgetting.add(task)  # (kept referenced; a drain does not wait for it)
        task.add_done_callback(self._forgetting.discard)

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


def _shard_failed(decode_id: str, prefill_rank: int, decode_rank: int, why: str) -> UpstreamError:
    log.warning("KV shard stream from prefill rank %d to decode %s rank %d failed: %s", prefill_rank, decode_id,
                decode_rank, why)  # fmt: skip
    return UpstreamError("UNAVAILABLE", f"decode {decode_id}: its rank {decode_rank} did not take the prompt's KV "
                                        f"from prefill rank {prefill_rank}")


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
    start_kv_transfer(engine, "prefill", args)
    servicer = PrefillServicer(engine, metrics, ChannelPool(args.tls))
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server.grpc)
    return servicer


def main(argv=None) -> None:
    engine_main("prefill", "Prefill tier: chunked prefill + KV shipping", _add_servicer, export_kv=True, argv=argv)
