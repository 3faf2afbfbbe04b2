"""KVConnector: the prefill -> decode KV protocol of one engine, on both tiers (vLLM v1's KVConnector, adapted).

The prefill tier is the producer: after each step's forward, save_kv copies the blocks the step filled out of the
pool, and the service ships them (services/kv_wire.py). The decode tier is the consumer: reserve holds blocks for
a prompt, import_kv writes the blocks that arrive into them, and finish_kv_import checks the transfer is complete
before the request may decode. request_finished forgets a request's transfer state.

Where vLLM's names fit, they are used: save_kv is save_kv_layer + wait_for_save for every layer at once (this
engine runs the whole forward first), and request_finished is its namesake. The consumer differs from vLLM's:
there the decode pulls the KV (get_num_new_matched_tokens, update_state_after_alloc, start_load_kv,
get_finished); here the prefill pushes it, and it arrives between steps through the service, so reserve,
import_kv and finish_kv_import take its place.

Tensor parallelism (docs/parallelism.md, "Prefill and decode of different sizes"): this connector is rank 0's and
moves rank 0's KV heads only; the other ranks ship and receive their own heads (services/kv_shards.py), told by
rank 0 over their pipes: ExpectKV at reserve, ForgetKV when a request waiting for KV is freed, a CheckKV round trip
before the request decodes, and on the prefill tier ExportKV after each step (CancelKV on an abort).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.shared.config import ModelConfig
from tandem.shared.errors import InvalidRequestError, NoCapacityError
from tandem.shared.kv_cache_manager import KVCacheManager
from tandem.shared.parallel.kv_heads import kv_head_range
from tandem.shared.parallel.messages import CancelKV, CheckKV, ExpectKV, ExportKV, ForgetKV, KVExport
from tandem.shared.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from tandem.shared.model_runner import ModelRunner
    from tandem.shared.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class KVBlocks:
    """Consecutive logical blocks of one request for layers layer_start.. (all layers when exported), of the
    model's KV heads head_start.. (as many as data holds).

    data [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in the KV cache dtype.
    """

    first_block_index: int
    data: torch.Tensor
    layer_start: int = 0
    head_start: int = 0


def new_received(num_blocks: int, num_layers: int, num_heads: int) -> torch.Tensor:
    """Which layers of which heads of which blocks of a request arrived: [num_blocks, num_layers, num_heads] bool."""
    return torch.zeros(num_blocks, num_layers, num_heads, dtype=torch.bool)


def write_kv(pool: torch.Tensor, block_table: list[int | None], received: torch.Tensor, kv_skip_blocks: int,
             kv: KVBlocks, held_start: int) -> int:
    """Write received blocks into pool [num_layers, 2, num_blocks, block_size, heads held, row] at the request's
    block ids and mark them in received (new_received). held_start: the model's first KV head the pool holds.
    Blocks before kv_skip_blocks are marked, never written (cached blocks are shared with other requests; blocks
    before the window were freed). InvalidRequestError when the blocks, layers or heads overrun the request or the
    pool. Returns the blocks written."""
    n, num_layers, num_heads = kv.data.shape[2], kv.data.shape[0], kv.data.shape[4]
    if kv.first_block_index + n > len(block_table):
        raise InvalidRequestError(f"KV blocks {kv.first_block_index}..{kv.first_block_index + n} exceed the "
                                  f"request's {len(block_table)} reserved blocks (first_block_index, num_blocks)")
    if kv.layer_start + num_layers > pool.shape[0]:
        raise InvalidRequestError(f"KV layers from {kv.layer_start} overrun the model's {pool.shape[0]} layers")
    h0 = kv.head_start - held_start
    if h0 < 0 or h0 + num_heads > pool.shape[4]:
        raise InvalidRequestError(f"KV heads [{kv.head_start}, {kv.head_start + num_heads}) are not held here "
                                  f"([{held_start}, {held_start + pool.shape[4]})): kv_head_start")  # fmt: skip
    received[kv.first_block_index : kv.first_block_index + n, kv.layer_start : kv.layer_start + num_layers,
             h0 : h0 + num_heads] = True  # fmt: skip
    skip = max(0, kv_skip_blocks - kv.first_block_index)
    if skip >= n:
        return 0
    ids = torch.tensor(block_table[kv.first_block_index + skip : kv.first_block_index + n], device=pool.device)
    layers = pool[kv.layer_start : kv.layer_start + num_layers]
    data = kv.data[:, :, skip:].to(pool.device)
    if num_heads == pool.shape[4]:
        layers.index_copy_(2, ids, data)
    else:  # (a part of the heads held: the heads dim is not contiguous in the pool)
        layers[:, :, :, :, h0 : h0 + num_heads].index_copy_(2, ids, data)
    return n - skip


def missing_kv(received: torch.Tensor, kv_skip_blocks: int) -> str | None:
    """Why a transfer is incomplete (some layer of some head of a block from kv_skip_blocks on never came), or
    None."""
    missing = (~received[kv_skip_blocks:].flatten(1).all(dim=1)).nonzero().flatten()
    if not len(missing):
        return None
    return (f"KV transfer incomplete: {len(missing)} of the {len(received) - kv_skip_blocks} blocks it needed lack "
            f"layers (the first: block {int(missing[0]) + kv_skip_blocks})")


class KVConnector:
    def __init__(self, model_config: ModelConfig, model_runner: ModelRunner, kv_cache_manager: KVCacheManager,
                 scheduler: Scheduler, is_kv_producer: bool = False):
        """is_kv_producer: the prefill tier (save_kv returns the blocks each step filled; otherwise nothing)."""
        self.num_layers, self.vocab_size = model_config.num_hidden_layers, model_config.vocab_size
        self.model_runner = model_runner  # (its kv_caches: the pool the blocks are copied out of and into)
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.scheduler = scheduler
        self.is_kv_producer = is_kv_producer
        self.tp = getattr(model_runner, "tp", None)  # (a tensor-parallel group: its other ranks move their heads)
        self.kv_heads = kv_head_range(self.tp.rank, self.tp.size, model_config.num_key_value_heads) if self.tp \
            else (0, model_config.num_key_value_heads)  # the model's KV heads this rank's pool holds
        self.num_blocks_exported = self.num_blocks_imported = 0  # since start
        self._num_exported_blocks: dict[str, int] = {}  # producer: leading blocks of a request already saved
        # consumer: each request waiting for its KV (RequestStatus.WAITING_FOR_KV, from reserve until
        # finish_kv_import or request_finished), and which layers of which heads of which of its blocks arrived
        # (new_received)
        self._receiving: dict[str, tuple[Request, torch.Tensor]] = {}

    # -- consumer (decode tier): reserve -> import_kv ... -> finish_kv_import ------------------------------
    def reserve(self, request: Request) -> int:
        """Hold blocks for an admitted request's prompt (and the output a migrated request arrives with:
        Request.output_token_ids; "prompt" below means both), to be filled by import_kv, reusing the longest cached
        prefix; the request then waits for its KV (RequestStatus.WAITING_FOR_KV). Returns the prompt tokens
        already cached here (a multiple of block_size). request.kv_skip_blocks is set to the leading blocks whose
        KV need not come: those cached, and with a sliding window on every layer those wholly before the window
        of the last prompt position (freed at once, KVCacheManager.free_out_of_window_blocks). Without room,
        running requests
        of lower priority are preempted (newest first) until it fits. NoCapacityError if the pool has no room now
        (nothing held; with room_soon when requests of lower priority still waiting for their KV hold blocks:
        preemptible once they decode)."""
        computed_block_ids, num_cached = self.kv_cache_manager.get_computed_blocks(request)
        while not self.kv_cache_manager.allocate_slots(request, request.num_tokens - num_cached,
                                                       computed_block_ids):  # fmt: skip
            victim = self.scheduler.lowest_priority_running()
            if victim is None or victim.priority <= request.priority:
                self.kv_cache_manager.free(request)
                room_soon = any(r.priority > request.priority for r, _ in self._receiving.values())
                raise NoCapacityError(f"no room for {request.num_tokens} prompt tokens of KV", room_soon)
            self.scheduler.preempt(victim)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_tokens = num_cached
        # (the window of the last prompt position: the first decoded one sees one more; this also keeps the prefill's
        # rule that at least the block of the prompt's last token comes, whatever the window)
        last = request.num_tokens - 1
        self.kv_cache_manager.free_out_of_window_blocks(request, last)
        request.kv_skip_blocks = max(num_cached // self.block_size,
                                     self.kv_cache_manager.num_blocks_before_window(last))
        block_table = self.kv_cache_manager.get_block_table(request.request_id)
        heads = self.kv_heads[1] - self.kv_heads[0]
        self._receiving[request.request_id] = (request, new_received(len(block_table), self.num_layers, heads))
        if self.tp is not None:  # (the other ranks write their heads into the same block ids)
            self.tp.send(ExpectKV(request.request_id, list(block_table), request.kv_skip_blocks))
        return num_cached

    def import_kv(self, request: Request, kv: KVBlocks) -> None:
        """Write received blocks into the pool at the request's reserved block ids (vLLM: start_load_kv), and
        record which layers of which blocks came (finish_kv_import checks that all did). kv.data
        [num_layers_in_msg, 2, n, block_size, num_kv_heads, head_dim] in the KV cache dtype. InvalidRequestError
        when the request is not waiting for KV or the blocks or layers overrun it."""
        if request.request_id not in self._receiving:
            raise InvalidRequestError(f"request {request.request_id!r} is not waiting for KV")
        block_table = self.kv_cache_manager.get_block_table(request.request_id)
        received = self._receiving[request.request_id][1]
        # NOTE: blocks this pool had cached are shared with other requests: never overwritten (write_kv)
        written = write_kv(self.model_runner.kv_caches, block_table, received, request.kv_skip_blocks, kv,
                           self.kv_heads[0])
        if kv.layer_start + kv.data.shape[0] == self.num_layers and \
                kv.head_start + kv.data.shape[4] == self.kv_heads[1]:  # count each block once
            self.num_blocks_imported += written

    def finish_kv_import(self, request: Request, first_token_id: int) -> None:
        """The last message of a transfer: check it, then mark the prompt's KV complete (num_computed_tokens =
        the prompt; its full blocks published in the prefix cache). The caller then appends first_token_id and
        puts the request in the batch. InvalidRequestError (nothing changed) when the request is not waiting for
        KV, the token is outside the vocabulary or its structured_output, or some layer of a block it lacked
        never arrived (the caller then fails the import); at tensor parallelism, on any rank (CheckKV)."""
        request_id = request.request_id
        if request_id not in self._receiving:
            raise InvalidRequestError(f"request {request_id!r} is not waiting for KV (its KV was completed already)")
        if not 0 <= first_token_id < self.vocab_size:
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        if request.grammar is not None and not request.grammar.num_valid([first_token_id]):
            raise InvalidRequestError(f"first token id {first_token_id} violates the request's structured_output")
        self._check_kv_complete(request)
        if self.tp is not None:
            for rank, error in enumerate(self.tp.ask(CheckKV(request_id)), start=1):
                if error is not None:
                    raise InvalidRequestError(f"{error} (tensor-parallel rank {rank})")
        del self._receiving[request_id]
        request.num_computed_tokens = request.num_tokens
        self.kv_cache_manager.cache_full_blocks(request)

    def _check_kv_complete(self, request: Request) -> None:
        """InvalidRequestError unless every layer of every block this pool needed (all but request.kv_skip_blocks)
        arrived by import_kv: a truncated transfer must never decode from stale blocks."""
        error = missing_kv(self._receiving[request.request_id][1], request.kv_skip_blocks)
        if error is not None:
            raise InvalidRequestError(error)

    # -- producer (prefill tier) ---------------------------------------------------------------------------
    def save_kv(self, scheduler_output: SchedulerOutput) -> dict[str, KVBlocks]:
        """After execute_model, before update_from_output (which frees finished requests): per request, a copy of
        the blocks this step filled (the partial last block too once the prompt is done), and on its first step
        also its leading blocks found in the prefix cache from request.kv_skip_blocks on (the blocks the receiving
        decode lacks); none for pooling requests. Each KVBlocks holds all layers (of this rank's heads: at tensor
        parallelism the other ranks are sent ExportKV for the requests with a Request.kv_destination, and ship
        their own). Empty unless is_kv_producer."""
        if not self.is_kv_producer:
            return {}
        saved, exports = {}, []
        for request in scheduler_output.scheduled_requests:
            if request.pooling_params is not None:  # (its KV stays here: nothing decodes it)
                continue
            start = request.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[request.request_id]
            first = self._num_exported_blocks.get(request.request_id, request.kv_skip_blocks)
            last = self.kv_cache_manager.num_blocks_for(end) if end == request.num_tokens else end // self.block_size
            if last > first:
                self._num_exported_blocks[request.request_id] = last
                self.num_blocks_exported += last - first
                block_ids = self.kv_cache_manager.get_block_table(request.request_id)[first:last]
                ids = torch.tensor(block_ids, device=self.model_runner.device)
                saved[request.request_id] = KVBlocks(first, self.model_runner.kv_caches.index_select(2, ids),
                                                     head_start=self.kv_heads[0])
                if self.tp is not None and request.kv_destination is not None:
                    exports.append(KVExport(request.request_id, first, list(block_ids), end == request.num_tokens,
                                            request.kv_destination))  # fmt: skip
        if exports:
            self.tp.send(ExportKV(exports))
        return saved

    # -- both ----------------------------------------------------------------------------------------------
    def request_finished(self, request: Request) -> None:
        """The request ended (finished, failed or aborted; its blocks are freed by the caller): forget it. At tensor
        parallelism the other ranks forget it too before the next step can reuse its blocks: ForgetKV (a request
        still waiting for its KV: a late message must not write into freed blocks), CancelKV (a prefill aborted
        while its KV streams)."""
        exported = self._num_exported_blocks.pop(request.request_id, None) is not None
        receiving = self._receiving.pop(request.request_id, None) is not None
        if self.tp is not None and receiving:
            self.tp.send(ForgetKV(request.request_id))
        if self.tp is not None and exported and request.kv_destination is not None and \
                request.finish_reason == FinishReason.ABORT:
            self.tp.send(CancelKV(request.request_id))
