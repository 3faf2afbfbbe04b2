"""Heterogeneous P/D (docs/parallelism.md, "Prefill and decode of different sizes"): a cluster (real Redis, gateway,
one prefill, one decode) whose tiers run different tensor-parallel sizes, each prefill rank shipping its KV heads
straight to the decode ranks holding them. One cluster serves both cases: prefill TP 2 -> decode TP 1, then (both
engines restarted with the sizes swapped, the same gateway and Redis) prefill TP 1 -> decode TP 2, on the tiny
Qwen2 checkpoint of 4 query heads over 2 KV heads; greedy tokens equal HF transformers' in fp32, and a second
prompt extending the first hits the prefix cache on both tiers (the decode's num_skip_blocks > 0: only the blocks it
lacks travel); requests cancelled at points through their prefill and transfer leave nothing behind on either
tier, a shard stream that fails fails the Prefill call (UNAVAILABLE, naming the decode), and a decode size and
endpoints that do not fit are refused by name."""
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from tests.integration.helpers import load, tracebacks, wait_idle
from tests.prompts import LONG_TEXT
from tests.tiny_models import NUM_TOKENS, save_tiny

ENGINE = ["--num-blocks", "128", "--threads", "1", "--kernel-threads", "1", "--block-size", "16"]
TEXTS = [LONG_TEXT[:300], LONG_TEXT[:300] + " And then, as the evening came,"]  # (the second extends the first)


@pytest.fixture(scope="module")
def pd(model_dir, tokenizer, tmp_path_factory):
    """(cluster, HF model) of prefill TP 2 -> decode TP 1 at first; switch_sizes() changes it."""
    from transformers import AutoModelForCausalLM

    from tandem.services.launcher import LocalCluster

    path = save_tiny("qwen2", tmp_path_factory.mktemp("pd") / "qwen2", tokenizer_from=model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cluster = LocalCluster(str(path), prefill_args=ENGINE + ["--max-num-batched-tokens", "32",
                                                             "--tensor-parallel-size", "2"],
                           decode_args=ENGINE + ["--tensor-parallel-size", "1"],
                           gateway_args=["--local-prefill-tokens", "0"]).start()  # fmt: skip
    try:
        yield cluster, hf
    finally:
        cluster.stop()


def switch_sizes(cluster, prefill_tp: int, decode_tp: int) -> None:
    """Restart the prefill and the decode at these tensor-parallel sizes (each drains first; both start at once)."""
    changed = []
    for name, size in (("decode0", decode_tp), ("prefill0", prefill_tp)):
        argv = cluster.argv[name]
        i = len(argv) - 1 - argv[::-1].index("--tensor-parallel-size")
        if argv[i + 1] != str(size):
            cluster.terminate(name)
            argv[i + 1] = str(size)
            changed.append(name)
    if changed:
        cluster.restart(*changed)


def check_through_the_cluster(cluster, hf, tokenizer, prefill_tp: int, decode_tp: int) -> None:
    from tandem.services.client import generate, make_request

    records = {name: load(address) for name, address in cluster.addresses.items()}
    imported = records["decode0"].num_blocks_imported
    outs = [generate(cluster.gateway_address, make_request(text, raw=True, max_tokens=NUM_TOKENS, temperature=0.0),
                     timeout=120) for text in TEXTS]  # fmt: skip
    for text, out in zip(TEXTS, outs):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.inference_mode():  # (HF stops at an EOS, as the engine does)
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)[0, len(ids):]
        expected = expected.tolist()
        assert out.token_ids == expected, (prefill_tp, decode_tp, text[-20:])
    assert outs[1].cached_tokens >= 48, "the second prompt extends the first: its leading blocks are cached"
    after = {name: load(address) for name, address in cluster.addresses.items()}
    assert after["decode0"].num_blocks_imported > imported, "the KV came from the prefill"
    for name in ("prefill0", "decode0"):  # (on the decode: num_skip_blocks > 0, only the blocks it lacks came)
        assert after[name].prefix_cache_hits >= records[name].prefix_cache_hits + 48, name
    cancel_at_points(cluster)
    loads = wait_idle(cluster)  # (every block freed on both tiers, nothing left waiting for KV)
    assert all(lo.num_waiting_for_kv == 0 for lo in loads.values()), loads
    assert all((lo.num_free_blocks, lo.num_running, lo.num_waiting) == (lo.num_blocks, 0, 0) for lo in loads.values())
    assert not tracebacks(cluster)


def cancel_at_points(cluster) -> None:
    """Long prompts (a prefix of their own each: cache_salt) cancelled by the client at points through their
    prefill and KV transfer (the prefill aborts: its ranks' shard streams are cancelled; the decode frees the
    reservation: its ranks forget the request)."""
    from tandem.services.client import make_request
    from tandem.v1 import gateway_pb2_grpc

    def run(delay: float) -> None:
        request = make_request(LONG_TEXT[:1500], raw=True, max_tokens=4, temperature=0.0, cache_salt=f"c{delay}")
        with grpc.insecure_channel(cluster.gateway_address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60)
            timer = threading.Timer(delay, call.cancel)
            timer.start()
            try:
                for _ in call:
                    pass
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED, e
            finally:
                timer.cancel()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, [0.05, 0.2, 0.4, 0.7]))


def test_prefill_tp2_to_decode_tp1(pd, tokenizer):
    cluster, hf = pd
    switch_sizes(cluster, 2, 1)
    check_through_the_cluster(cluster, hf, tokenizer, 2, 1)
    a_failed_shard_stream_fails_the_prefill(cluster)


def a_failed_shard_stream_fails_the_prefill(cluster) -> None:
    """The prefill told of a decode rank 1 whose endpoint nothing serves: prefill rank 1's shard stream fails, it
    reports so through the TCPStore, and the Prefill call fails UNAVAILABLE naming the decode, whose reservation is
    then freed (its Generate stream ends with the error the gateway re-places on)."""
    import json

    import redis

    from tandem.services.launcher import free_port
    from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    client = redis.Redis.from_url(cluster.redis_url)
    try:
        decode = json.loads(client.get(client.keys("tandem:instance:decode:*")[0]))
    finally:
        client.close()
    ids = list(range(3, 60))
    with grpc.insecure_channel(decode["address"]) as d, grpc.insecure_channel(cluster.addresses["prefill0"]) as p:
        request = decode_pb2.DecodeRequest(request_id="broken", prompt_token_ids=ids)
        request.sampling_params.max_tokens = 4
        call = decode_pb2_grpc.DecodeStub(d).Generate(request, timeout=60)
        assert next(call).reserved
        prefill = prefill_pb2.PrefillRequest(request_id="broken", prompt_token_ids=ids,
                                             decode_address=decode["address"], decode_instance_id=decode["instance_id"],
                                             decode_tensor_parallel_size=2,
                                             decode_kv_endpoints=[decode["address"], f"127.0.0.1:{free_port()}"])
        prefill.sampling_params.max_tokens = 1
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillStub(p).Prefill(prefill, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
        assert f"decode {decode['instance_id']}: its rank 1 did not take" in e.value.details()
        replies = list(call)
        assert replies[-1].error and replies[-1].error_is_unavailable, replies
        for size, endpoints, field in ((2, [decode["address"]], "decode_kv_endpoints lists 1 endpoints"),
                                       (3, [decode["address"]] * 3, "decode_tensor_parallel_size 3")):
            refused = prefill_pb2.PrefillRequest(request_id="refused", prompt_token_ids=ids,
                                                 decode_address=decode["address"], decode_tensor_parallel_size=size,
                                                 decode_kv_endpoints=endpoints)  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                prefill_pb2_grpc.PrefillStub(p).Prefill(refused, timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), e.value
    loads = wait_idle(cluster)
    assert all((lo.num_free_blocks, lo.num_running, lo.num_waiting) == (lo.num_blocks, 0, 0) for lo in loads.values())


def test_prefill_tp1_to_decode_tp2(pd, tokenizer):
    import json

    import redis

    cluster, hf = pd
    switch_sizes(cluster, 1, 2)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        record = json.loads(client.get(client.keys("tandem:instance:decode:*")[0]))
    finally:
        client.close()
    assert record["tensor_parallel_size"] == 2 and len(record["kv_endpoints"]) == 2
    assert record["kv_endpoints"][0] == record["address"]
    check_through_the_cluster(cluster, hf, tokenizer, 1, 2)


@pytest.mark.heavy  # (a cluster of its own: about 25 s more)
def test_one_kv_head_replicated_prefill_tp2_to_decode_tp2(model_dir, tokenizer, tmp_path):
    """Llama 3 with 1 KV head (4 query heads) at TP 2 on both tiers: both prefill ranks hold the head and only rank
    0 sends it (rank 1's ExportKV opens no stream); both decode ranks hold it and each gets it (rank 0 on the
    control stream, rank 1 on its TransferKVShard)."""
    from transformers import AutoModelForCausalLM

    from tandem.services.launcher import LocalCluster

    path = save_tiny("llama3", tmp_path / "llama3", tokenizer_from=model_dir,
                     overrides={"num_key_value_heads": 1, "attention_bias": True})  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tp2 = ["--tensor-parallel-size", "2"]
    with LocalCluster(str(path), prefill_args=ENGINE + ["--max-num-batched-tokens", "32"] + tp2,
                      decode_args=ENGINE + tp2, gateway_args=["--local-prefill-tokens", "0"]) as cluster:  # fmt: skip
        check_through_the_cluster(cluster, hf, tokenizer, 2, 2)


@pytest.mark.heavy  # (a cluster of its own over TLS: about 15 s more)
def test_every_kv_stream_speaks_mutual_tls(model_dir, tokenizer, tmp_path):
    """A cluster over mutual TLS (one CA, as `tandem up --tls-*` gives it) with both tiers at TP 2 on the Qwen2 of 2
    KV heads: prefill rank 0 sends head 0 on the control stream to decode rank 0, and prefill rank 1 sends head 1
    from its own process to decode rank 1's own server, both with the instance's certificate; the answer equals HF
    fp32's, and the decode's rank 1 took its head (the whole prompt's blocks were imported and checked)."""
    trustme = pytest.importorskip("trustme")
    from transformers import AutoModelForCausalLM

    from tandem.services.client import generate, make_request
    from tandem.services.launcher import LocalCluster
    from tandem.services.security import TLSConfig

    ca, pki = trustme.CA(), tmp_path / "pki"
    pki.mkdir()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(pki / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(pki / "service.pem")
    cert.private_key_pem.write_to_path(pki / "service.key")
    tls = TLSConfig(str(pki / "service.pem"), str(pki / "service.key"), str(pki / "ca.pem"))
    path = save_tiny("qwen2", tmp_path / "qwen2", tokenizer_from=model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tp2 = ["--tensor-parallel-size", "2"]
    with LocalCluster(str(path), prefill_args=ENGINE + ["--max-num-batched-tokens", "32"] + tp2,
                      decode_args=ENGINE + tp2, gateway_args=["--local-prefill-tokens", "0"], tls=tls) as cluster:
        out = generate(cluster.gateway_address, make_request(TEXTS[0], raw=True, max_tokens=NUM_TOKENS,
                                                             temperature=0.0), timeout=120, tls=tls)  # fmt: skip
        ids = tokenizer(TEXTS[0], add_special_tokens=False).input_ids
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)[0, len(ids):]
        assert out.token_ids == expected.tolist()
        assert not tracebacks(cluster)
