"""The typed messages rank 0 sends the other ranks of a tensor-parallel instance (one pipe each,
shared/parallel/group.py): WorkerInit once, then a StepInput per forward, and Shutdown; and the KV transfer's
(docs/parallelism.md): KVTransferInit once, ExpectKV / ForgetKV / CheckKV on a decode, ExportKV / CancelKV on a
prefill. KVTransferInit and CheckKV are answered on the same pipe (TensorParallelGroup.ask). Pickled, and read back
by an unpickler that admits only these classes and the config records they carry (never a callable)."""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from typing import Any

from tandem.shared.config import CacheConfig, ModelConfig


@dataclass(frozen=True, slots=True)
class WorkerInit:
    """What a rank > 0 needs to build its ModelRunner: the model and the KV pool (num_blocks may still be None:
    rank 0 resolves it after loading and sends the resolved CacheConfig next)."""

    model_config: ModelConfig
    cache_config: CacheConfig


@dataclass(frozen=True, slots=True)
class StepInput:
    """One forward of the model runner (shared/model_runner.py run_model's arguments): block copies first, then
    per sequence (token_ids, start, block_table, num_logits); rope_long per sequence or None; pooled: indices of
    the sequences whose final hidden state is wanted, or None. Every rank runs it on its own shards and KV pool."""

    block_copies: list[tuple[int, int]]
    seqs: list[tuple[list[int], int, list[int | None], int]]
    rope_long: list[bool] | None
    pooled: list[int] | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The instance stops: a rank > 0 exits 0."""


@dataclass(frozen=True, slots=True)
class KVTransferInit:
    """The service's KV role, sent once before it serves: "decode" (the rank serves TransferKVShard on
    bind_host, an OS-chosen port, with tls: services.security.TLSConfig or None) or "prefill" (it ships its heads'
    KV, calling the decodes with tls). Answered with (the rank's KV endpoint, advertise_host:port ("" on a
    prefill), None), or ("", why it cannot)."""

    role: str
    bind_host: str
    advertise_host: str
    tls: Any = None


@dataclass(frozen=True, slots=True)
class ExpectKV:
    """Decode: a request was reserved; its KV may arrive for block_table (the same ids on every rank) from block
    kv_skip_blocks on."""

    request_id: str
    block_table: list[int | None]
    kv_skip_blocks: int


@dataclass(frozen=True, slots=True)
class ForgetKV:
    """Decode: the request was freed before its KV completed: write nothing more for it (its blocks may be
    reused by the next StepInput)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class CheckKV:
    """Decode, at finish_kv_import: answered with None when every layer of every head this rank holds of every
    block from kv_skip_blocks on arrived, else why not; the rank then forgets the request."""

    request_id: str


@dataclass(frozen=True, slots=True)
class KVDestination:
    """Where a prefill's request's KV goes: the decode's tensor-parallel size and each rank's KV endpoint
    (rank order; rank 0's the decode's address); serial names this transfer in the outcomes the ranks report
    (the instance's TCPStore: kv_outcome_key)."""

    serial: int
    decode_instance_id: str
    decode_size: int
    endpoints: list[str]


@dataclass(frozen=True, slots=True)
class KVExport:
    """Prefill: blocks first_block_index.. (their ids, block_ids) of a request were filled by the step just run;
    last: the prompt is complete (its streams end after these)."""

    request_id: str
    first_block_index: int
    block_ids: list[int]
    last: bool
    destination: KVDestination


@dataclass(frozen=True, slots=True)
class ExportKV:
    """Prefill, after a step's forward: each rank copies its heads of these blocks and streams them on."""

    exports: list[KVExport]


@dataclass(frozen=True, slots=True)
class CancelKV:
    """Prefill: the request was aborted: its shard streams are cancelled."""

    request_id: str


def kv_outcome_key(serial: int, rank: int, decode_rank: int) -> str:
    """The TCPStore key where prefill rank `rank` reports its shard stream of transfer serial to decode_rank:
    "" when acknowledged, else why it failed."""
    return f"kv/{serial}/{rank}/{decode_rank}"


_ALLOWED = {(__name__, name) for name in ("WorkerInit", "StepInput", "Shutdown", "KVTransferInit", "ExpectKV",
                                          "ForgetKV", "CheckKV", "KVDestination", "KVExport", "ExportKV",
                                          "CancelKV")} | {
    ("tandem.shared.config", "ModelConfig"), ("tandem.shared.config", "CacheConfig"),
    ("tandem.services.security", "TLSConfig")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a tensor-parallel message")
        return super().find_class(module, name)


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


__all__ = ["CacheConfig", "CancelKV", "CheckKV", "ExpectKV", "ExportKV", "ForgetKV", "KVDestination", "KVExport",
           "KVTransferInit", "ModelConfig", "Shutdown", "StepInput", "WorkerInit", "decode", "encode",
           "kv_outcome_key"]
