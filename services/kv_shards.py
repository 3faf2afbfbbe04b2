"""The data plane of a tensor-parallel rank > 0 (heterogeneous P/D, docs/parallelism.md): each rank ships or
receives the KV heads it holds itself; nothing gathers the heads on rank 0, which only carries the control.

- Decode rank: a gRPC server of its own (the instance's TLS settings, an OS-chosen port on its host) serving
  Decode.TransferKVShard into this rank's pool (shared/parallel/kv_shards.py KVShardReceiver: what rank 0 said it
  expects over the pipe).
- Prefill rank: after each step rank 0 sends ExportKV; the rank copies its heads of those blocks out of its pool and
  streams them, one TransferKVShard client stream per request and decode rank (kv_transfer_routes: only the heads
  it is the lowest holder of), ending each stream with the totals; each stream's outcome goes to the instance's
  TCPStore (kv_outcome_key), where rank 0 waits for it before it sends the control stream's last message.

Runs in a service's rank process (services/tp_worker.py: shared/parallel/worker.py's loop), which hands it rank 0's
KV messages (handle).
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent import futures

import grpc
import torch

from tandem.services.kv_wire import KVTransferTally, kv_from_message, kv_to_messages, last_message
from tandem.services.security import open_channel
from tandem.services.server import GRPC_OPTIONS
from tandem.shared.errors import InvalidRequestError, UnknownRequestError
from tandem.shared.kv_connector import KVBlocks
from tandem.shared.parallel.kv_heads import kv_head_range, kv_transfer_routes
from tandem.shared.parallel.kv_shards import KVShardReceiver
from tandem.shared.parallel.messages import (CancelKV, CheckKV, ExpectKV, ExportKV, ForgetKV, KVExport,
                                             KVTransferInit, kv_outcome_key)
from tandem.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)
SHARD_STREAM_TIMEOUT_S = 600.0  # a stream's deadline (a prefill's prompt computes within it)
SERVER_THREADS = 32  # TransferKVShard streams a decode rank receives at once (more wait for a thread)


class ShardServicer(decode_pb2_grpc.DecodeServicer):
    """Decode rank > 0: TransferKVShard only (the other Decode methods are rank 0's: UNIMPLEMENTED here)."""

    def __init__(self, receiver: KVShardReceiver, model_config, cache_config, rank: int):
        self.receiver, self.model_config, self.cache_config, self.rank = receiver, model_config, cache_config, rank

    def TransferKVShard(self, request_iterator, context):
        try:
            return receive_shard(request_iterator, self.model_config, self.cache_config, self.receiver.kv_heads,
                                 self.receiver.write)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"decode rank {self.rank}: {e}")
        except UnknownRequestError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"decode rank {self.rank}: {e}")


def receive_shard(messages, model_config, cache_config, kv_heads: tuple[int, int], write) -> \
        decode_pb2.TransferKVResponse:
    """One TransferKVShard stream (sync or, with write a coroutine, see DecodeServicer): each data message
    checked (kv_from_message against kv_heads) and written by write(request_id, KVBlocks); the last message's
    totals checked. InvalidRequestError naming the field, UnknownRequestError from write."""
    tally = None
    for msg in messages:
        tally = tally or KVTransferTally(msg.request_id, model_config.num_hidden_layers)
        tally.add(msg)
        if msg.num_blocks or msg.data:
            if not msg.num_blocks:
                raise InvalidRequestError(f"KV transfer refused: num_blocks is 0 but data has {len(msg.data)} bytes")
            write(msg.request_id, kv_from_message(msg, model_config, cache_config, kv_heads))
        if msg.HasField("num_messages_sent"):
            tally.check_totals(msg)
            return decode_pb2.TransferKVResponse(num_blocks_received=tally.num_blocks)
    raise InvalidRequestError("KV transfer incomplete: the shard stream ended without its last message "
                              "(num_messages_sent)")  # fmt: skip


class _ShardStream:
    """One client stream of a request's KV heads to one decode rank (prefill rank > 0)."""

    def __init__(self, owner: ShardSender, request_id: str, export: KVExport, decode_rank: int, heads: tuple[int, int]):
        self.owner, self.request_id, self.decode_rank, self.heads = owner, request_id, decode_rank, heads
        self.key = kv_outcome_key(export.destination.serial, owner.rank, decode_rank)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.num_messages = self.num_blocks = 0
        stub = decode_pb2_grpc.DecodeStub(owner.channel(export.destination.endpoints[decode_rank]))
        self.call = stub.TransferKVShard.future(self._messages(), timeout=SHARD_STREAM_TIMEOUT_S)
        self.call.add_done_callback(self._done)

    def put(self, kv: KVBlocks) -> None:
        if self.call.done():  # (it failed: its outcome is reported, nothing reads the queue)
            return
        for msg in kv_to_messages(self.request_id, kv, self.owner.model_config, kv_dtype=self.owner.kv_dtype):
            self.queue.put(msg)
            self.num_messages += 1
        self.num_blocks += kv.data.shape[2]

    def close(self) -> None:
        self.queue.put(last_message(self.request_id, None, self.num_messages, self.num_blocks))
        self.queue.put(None)

    def _messages(self):
        while (msg := self.queue.get()) is not None:
            yield msg

    def _done(self, call) -> None:
        if call.cancelled():
            outcome = "cancelled"
        elif call.exception() is not None:
            e = call.exception()
            outcome = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else repr(e)
        elif call.result().num_blocks_received != self.num_blocks:
            outcome = f"acknowledged {call.result().num_blocks_received} blocks, {self.num_blocks} were sent"
        else:
            outcome = ""
        self.owner.finished(self, outcome)


class ShardSender:
    """Prefill rank > 0: the shard streams of the requests whose KV it is shipping."""

    def __init__(self, pool: torch.Tensor, rank: int, size: int, model_config, kv_dtype: str, tls, store):
        self.pool, self.rank, self.size = pool, rank, size
        self.model_config, self.kv_dtype, self.tls, self.store = model_config, kv_dtype, tls, store
        self.kv_heads = kv_head_range(rank, size, model_config.num_key_value_heads)
        self._channels: dict[str, grpc.Channel] = {}
        self._streams: dict[str, list[_ShardStream]] = {}  # request id -> its open streams
        self._lock = threading.Lock()

    def channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.tls, GRPC_OPTIONS, aio=False)
        return self._channels[address]

    def export(self, message: ExportKV) -> None:
        """Copy this rank's heads of each export's blocks out of the pool (now: the next step may reuse them) and
        queue them on the request's streams (opened on its first export); the last export closes them. A rank
        that sends none of the request's heads (a replica) does nothing."""
        for export in message.exports:
            with self._lock:
                streams = self._streams.get(export.request_id)
            if streams is None:
                streams = self._open(export)
            if streams:
                data = self.pool.index_select(2, torch.tensor(export.block_ids, device=self.pool.device)).cpu()
            for stream in streams:
                h0, h1 = stream.heads[0] - self.kv_heads[0], stream.heads[1] - self.kv_heads[0]
                part = data if (h0, h1) == (0, data.shape[4]) else data[:, :, :, :, h0:h1].contiguous()
                stream.put(KVBlocks(export.first_block_index, part, head_start=stream.heads[0]))
                if export.last:
                    stream.close()
            if export.last:  # (its streams end on their own; CancelKV finds nothing left to cancel)
                with self._lock:
                    self._streams.pop(export.request_id, None)

    def _open(self, export: KVExport) -> list[_ShardStream]:
        destination = export.destination
        routes = [r for r in kv_transfer_routes(self.size, destination.decode_size,
                                                self.model_config.num_key_value_heads) if r.prefill_rank == self.rank]
        streams = [_ShardStream(self, export.request_id, export, r.decode_rank, (r.head_start, r.head_end))
                   for r in routes]  # fmt: skip
        if streams and not export.last:
            with self._lock:
                self._streams[export.request_id] = streams
        return streams

    def cancel(self, request_id: str) -> None:
        with self._lock:
            streams = self._streams.pop(request_id, [])
        for stream in streams:
            stream.call.cancel()

    def finished(self, stream: _ShardStream, outcome: str) -> None:
        """A stream ended: its outcome to the store, where rank 0 waits for it (or, once it gave up waiting,
        deletes it)."""
        if outcome:
            log.warning("request %s: KV shard stream to decode rank %d failed: %s", stream.request_id,
                        stream.decode_rank, outcome)  # fmt: skip
        with self._lock:  # (the store's client, from gRPC's threads)
            try:
                self.store.set(stream.key, outcome)
            except Exception as e:  # (rank 0 is gone: nothing waits for it)
                log.warning("cannot report a KV shard stream's outcome: %s", e)


class RankKVTransfer:
    """A rank > 0's part of the KV transfer, built from KVTransferInit (ValueError naming a setting it cannot
    serve with, e.g. a TLS file it cannot read): handle(message) takes rank 0's KV messages and returns the answer
    of those that are asked (CheckKV)."""

    def __init__(self, init: KVTransferInit, runner, rank: int, size: int, store):
        self.role = init.role
        model_config, cache_config = runner.model_config, runner.cache_config
        self.kv_heads = kv_head_range(rank, size, model_config.num_key_value_heads)
        self.receiver = self.sender = self.server = None
        self.endpoint = ""
        if init.role == "decode":
            self.receiver = KVShardReceiver(runner.kv_caches, self.kv_heads)
            self.server = grpc.server(futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="kv-shards"),
                                      options=GRPC_OPTIONS)  # fmt: skip
            decode_pb2_grpc.add_DecodeServicer_to_server(
                ShardServicer(self.receiver, model_config, cache_config, rank), self.server)
            address = f"{init.bind_host}:0"
            port = (self.server.add_secure_port(address, init.tls.server_credentials()) if init.tls is not None
                    and init.tls.cert_file else self.server.add_insecure_port(address))  # fmt: skip
            self.server.start()
            self.endpoint = f"{init.advertise_host}:{port}"
            log.info("rank %d receives KV heads [%d, %d) on %s", rank, *self.kv_heads, self.endpoint)
        elif init.role == "prefill":
            self.sender = ShardSender(runner.kv_caches, rank, size, model_config, cache_config.kv_dtype, init.tls,
                                      store)  # fmt: skip
        else:
            raise ValueError(f"unknown KV role {init.role!r}")

    def handle(self, message):
        match message:
            case ExpectKV():
                self.receiver.expect(message)
            case ForgetKV(request_id):
                self.receiver.forget(request_id)
            case CheckKV(request_id):
                return self.receiver.check(request_id)
            case ExportKV():
                self.sender.export(message)
            case CancelKV(request_id):
                self.sender.cancel(request_id)
            case _:
                raise TypeError(f"not a KV message: {message!r}")
        return None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)


def start_kv_transfer(engine, role: str, args) -> list[str]:
    """Rank 0, before the server serves (the engine thread sends nothing yet): start the other ranks' part of the
    KV transfer (KVTransferInit, with the service's --host, --advertise-host and TLS settings). Returns their KV
    endpoints, ranks 1.. in order ("" each on a prefill); [] for a single-process engine. ValueError with a rank's
    reason when one cannot start it."""
    workers = engine.tp_workers
    if workers is None:
        return []
    try:
        answers = workers.group.ask(KVTransferInit(role, args.host, args.advertise_host, args.tls))
    except (EOFError, OSError) as e:
        raise ValueError(f"a tensor-parallel rank exited while starting its KV transfer ({e!r}): see its log") from e
    for rank, (_, error) in enumerate(answers, start=1):
        if error:
            raise ValueError(f"tensor-parallel rank {rank} cannot serve its KV transfer: {error}")
    return [endpoint for endpoint, _ in answers]
