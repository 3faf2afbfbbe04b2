"""Heterogeneous P/D's parts without a cluster (docs/parallelism.md): which KV heads each rank holds and who sends
which to whom, the wire's head range, and a decode rank's receiver (shared/parallel/kv_shards.py) with its gRPC
server (services/kv_shards.py): a head range it does not hold, a request it does not expect, and a late message
after ForgetKV are refused and write nothing."""
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
import torch

from tandem.services.kv_wire import kv_from_message, kv_to_messages, last_message
from tandem.shared.config import CacheConfig
from tandem.shared.errors import InvalidRequestError, UnknownRequestError
from tandem.shared.kv_connector import KVBlocks
from tandem.shared.parallel import kv_shards
from tandem.shared.parallel.kv_heads import kv_head_range, kv_heads_sent, kv_transfer_routes
from tandem.shared.parallel.kv_shards import KVShardReceiver
from tandem.shared.parallel.messages import ExpectKV, KVTransferInit

SIZES = range(1, 5)


def splits(num_kv_heads: int, size: int) -> bool:
    return not (num_kv_heads % size and size % num_kv_heads)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
def test_every_decode_rank_gets_each_head_it_holds_exactly_once(num_kv_heads):
    for a in SIZES:
        for b in SIZES:
            if not (splits(num_kv_heads, a) and splits(num_kv_heads, b)):
                with pytest.raises(ValueError, match="num_key_value_heads"):
                    kv_transfer_routes(a, b, num_kv_heads)
                continue
            routes = kv_transfer_routes(a, b, num_kv_heads)
            for d in range(b):
                start, end = kv_head_range(d, b, num_kv_heads)
                got = sorted(h for r in routes if r.decode_rank == d for h in range(r.head_start, r.head_end))
                assert got == list(range(start, end)), (a, b, num_kv_heads, d)
            for r in routes:  # a sender holds what it sends, and is the lowest rank holding it
                held = kv_head_range(r.prefill_rank, a, num_kv_heads)
                assert held[0] <= r.head_start < r.head_end <= held[1]
                assert all(kv_head_range(p, a, num_kv_heads)[1] <= r.head_start or
                           kv_head_range(p, a, num_kv_heads)[0] > r.head_start for p in range(r.prefill_rank))
            if a == b == 1:
                assert routes == [(0, 0, 0, num_kv_heads)]


@pytest.mark.parametrize("heads, num_kv_heads", [(4, 2), (4, 1), (8, 8), (8, 2), (12, 4)])
def test_head_ranges_are_the_heads_shard_model_keeps(heads, num_kv_heads):
    """shard_model's KV rows: the KV head of the rank's first query head, num_kv_heads_per_rank of them."""
    for size in SIZES:
        if heads % size or not splits(num_kv_heads, size):
            continue
        per_rank = max(1, num_kv_heads // size)
        for rank in range(size):
            kv0 = rank * (heads // size) // (heads // num_kv_heads)
            assert kv_head_range(rank, size, num_kv_heads) == (kv0, kv0 + per_rank)
    assert kv_heads_sent(1, 2, 1) == (0, 0)  # (rank 0 sends the replicated head)
    assert kv_heads_sent(1, 2, 2) == (1, 2)


@pytest.fixture
def wire(model_config):
    """(model config with 2 KV heads, cache config, data of 2 layers x 3 blocks for heads [1, 2))."""
    config = replace(model_config, num_key_value_heads=2, num_hidden_layers=2)
    data = torch.randn(2, 2, 3, 4, 1, config.head_dim)
    return config, CacheConfig(block_size=4, num_blocks=8), data


def test_the_wire_carries_a_head_range_and_two_single_ranks_send_what_they_sent(wire):
    config, cache, data = wire
    whole = kv_to_messages("r", KVBlocks(0, torch.cat([data, data], dim=4)), config)
    assert not whole[0].HasField("kv_head_start") and whole[0].num_kv_heads == 2
    msg = kv_to_messages("r", KVBlocks(0, data, head_start=1), config)[0]
    assert (msg.kv_head_start, msg.num_kv_heads) == (1, 1)
    assert kv_from_message(msg, config, cache, (1, 2)).head_start == 1
    for held in ((0, 1), (2, 3)):
        with pytest.raises(InvalidRequestError, match="kv_head_start 1 and num_kv_heads 1 name KV heads this decode "
                                                      "rank does not hold"):  # fmt: skip
            kv_from_message(msg, config, cache, held)
    assert not last_message("r", None, 1, 3).HasField("first_token_id")


def test_receiver_writes_its_heads_and_refuses_unknown_and_late_messages(wire):
    config, cache, data = wire
    pool = torch.zeros(2, 2, 8, 4, 1, config.head_dim)  # a decode rank holding head 1 of 2
    receiver = KVShardReceiver(pool, (1, 2))
    with pytest.raises(UnknownRequestError, match="not waiting for KV"):
        receiver.write("unknown", KVBlocks(0, data, head_start=1), wait_s=0.05)
    receiver.expect(ExpectKV("r", [5, 6, 7], kv_skip_blocks=1))
    assert receiver.write("r", KVBlocks(0, data[:, :, :2], head_start=1)) == 1  # (block 0 was cached: skipped)
    assert receiver.write("r", KVBlocks(2, data[:, :, 2:], head_start=1)) == 1
    assert torch.equal(pool[:, :, 6:8], data[:, :, 1:3]) and not pool[:, :, 5].any()
    with pytest.raises(InvalidRequestError, match="kv_head_start"):
        receiver.write("r", KVBlocks(0, data, head_start=0))
    assert receiver.check("r") is None and "r" not in receiver  # (complete; forgotten once checked)
    receiver.expect(ExpectKV("t", [1, 2, 3], kv_skip_blocks=0))
    receiver.write("t", KVBlocks(0, data[:1], head_start=1))  # (layer 0 only)
    assert receiver.check("t").startswith("KV transfer incomplete: 3 of the 3 blocks it needed lack layers")
    # a late message after ForgetKV (the request was freed; its blocks may be another's now) writes nothing
    receiver.expect(ExpectKV("s", [1, 2, 3], kv_skip_blocks=0))
    receiver.forget("s")
    before = pool.clone()
    with pytest.raises(UnknownRequestError):
        receiver.write("s", KVBlocks(0, data, head_start=1))  # (refused at once: no wait)
    assert torch.equal(pool, before)
    assert receiver.check("s") == "request 's' is not expected here"


def test_a_decode_ranks_server_refuses_by_name(wire, monkeypatch):
    """services/kv_shards.py RankKVTransfer's TransferKVShard server over gRPC on loopback."""
    from tandem.services.kv_shards import RankKVTransfer
    from tandem.v1 import decode_pb2_grpc

    config, cache, data = wire
    monkeypatch.setattr(kv_shards, "EXPECT_WAIT_S", 0.05)
    runner = SimpleNamespace(model_config=config, cache_config=cache,
                             kv_caches=torch.zeros(2, 2, 8, 4, 1, config.head_dim))
    rank = RankKVTransfer(KVTransferInit("decode", "127.0.0.1", "127.0.0.1"), runner, 1, 2, store=None)
    try:
        stub = decode_pb2_grpc.DecodeStub(grpc.insecure_channel(rank.endpoint))

        def send(request_id: str, head_start: int):
            msgs = kv_to_messages(request_id, KVBlocks(0, data, head_start=head_start), config)
            return stub.TransferKVShard(iter(msgs + [last_message(request_id, None, len(msgs), 3)]), timeout=30)

        with pytest.raises(grpc.RpcError) as e:
            send("unknown", 1)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        rank.handle(ExpectKV("r", [1, 2, 3], 0))
        with pytest.raises(grpc.RpcError) as e:
            send("r", 0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_head_start" in e.value.details()
        assert send("r", 1).num_blocks_received == 3
        assert torch.equal(runner.kv_caches[:, :, 1:4], data)
    finally:
        rank.close()


def test_pairing_needs_rank_endpoints_when_a_tier_runs_several_ranks():
    from tandem.shared.cluster_state.registry import InstanceInfo

    def record(tier, size=1, endpoints=None):
        info = InstanceInfo(f"{tier}-{size}", tier, f"{tier}:1", "m", 16, kv_dtype="float32")
        info.tensor_parallel_size = size
        info.kv_endpoints = [info.address] + [f"{tier}:{r}" for r in range(2, size + 1)] if endpoints is None \
            else endpoints  # fmt: skip
        return info

    old_prefill = InstanceInfo.from_json('{"instance_id": "p", "tier": "prefill", "address": "p:1", '
                                         '"model_id": "m", "block_size": 16}')  # (fields of an older record)
    assert (old_prefill.tensor_parallel_size, old_prefill.kv_endpoints) == (1, [])
    assert old_prefill.can_send_kv_to(record("decode"))  # (TP 1 -> TP 1: as before)
    assert not old_prefill.can_send_kv_to(record("decode", 2))  # (an older prefill sends all heads to rank 0)
    for p in (1, 2):
        for d in (1, 2):
            assert record("prefill", p).can_send_kv_to(record("decode", d)), (p, d)
    assert not record("prefill", 2).can_send_kv_to(record("decode", 2, endpoints=["decode:1"]))  # (rank 1's missing)
    assert not record("prefill", 2).can_send_kv_to(record("decode", 1, endpoints=[]))  # (an older decode)
    assert not record("prefill").can_send_kv_to(InstanceInfo("d", "decode", "d:1", "m", 32))  # (block size)


def test_a_decode_ranks_server_speaks_the_instances_mutual_tls(wire, tmp_path):
    """The rank's TransferKVShard server takes the instance's TLS settings: a peer presenting a certificate of its
    CA is served; one without a certificate is refused in the handshake."""
    trustme = pytest.importorskip("trustme")
    from tandem.services.kv_shards import RankKVTransfer
    from tandem.services.security import TLSConfig, open_channel
    from tandem.v1 import decode_pb2_grpc

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "service.pem")
    cert.private_key_pem.write_to_path(tmp_path / "service.key")
    tls = TLSConfig(str(tmp_path / "service.pem"), str(tmp_path / "service.key"), str(tmp_path / "ca.pem"),
                    require_client_cert=True)
    config, cache, data = wire
    runner = SimpleNamespace(model_config=config, cache_config=cache,
                             kv_caches=torch.zeros(2, 2, 8, 4, 1, config.head_dim))
    rank = RankKVTransfer(KVTransferInit("decode", "127.0.0.1", "127.0.0.1", tls), runner, 1, 2, store=None)
    try:
        rank.handle(ExpectKV("r", [1, 2, 3], 0))
        msgs = kv_to_messages("r", KVBlocks(0, data, head_start=1), config)
        msgs.append(last_message("r", None, len(msgs), 3))
        with open_channel(rank.endpoint, tls, aio=False) as channel:
            assert decode_pb2_grpc.DecodeStub(channel).TransferKVShard(iter(msgs), timeout=30).num_blocks_received == 3
        anonymous = TLSConfig(None, None, str(tmp_path / "ca.pem"))
        with open_channel(rank.endpoint, anonymous, aio=False) as channel, pytest.raises(grpc.RpcError) as e:
            decode_pb2_grpc.DecodeStub(channel).TransferKVShard(iter(msgs), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        rank.close()


def test_tandem_up_gives_each_tier_its_tensor_parallel_size():
    """tandem up's flags for each tier, read by that tier's own parser (services/flags.py: the last flag wins)."""
    import argparse

    from tandem.services.cli import build_parser, tier_engine_args
    from tandem.services.flags import add_engine_service_args, engine_argv
    from tandem.shared.engine_args import EngineArgs

    def sizes(*flags) -> tuple[int, int]:
        args = build_parser(["up", *flags]).parse_args(["up", *flags])
        served, tiers = [], tier_engine_args(args, engine_argv(EngineArgs.from_namespace(args)))
        for tier, argv in zip(("prefill", "decode"), tiers):
            parser = argparse.ArgumentParser()
            add_engine_service_args(parser, tier)
            served.append(parser.parse_args(argv).tensor_parallel_size)
        return tuple(served)

    assert sizes() == (1, 1)
    assert sizes("--tensor-parallel-size", "3") == (3, 3)
    assert sizes("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1") == (2, 1)
    assert sizes("--prefill-tensor-parallel-size", "2") == (2, 1)
    assert sizes("--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "2") == (1, 2)
