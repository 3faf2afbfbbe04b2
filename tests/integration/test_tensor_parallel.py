"""Tensor parallelism (docs/parallelism.md, shared/parallel/): an engine of 2 ranks over gloo on CPU (rank 0 here,
rank 1 a process it starts), greedy in fp32 token for token against HF transformers on tiny checkpoints whose heads
divide (4 query heads over 2 KV heads, and over 1 KV head replicated on both ranks, with o_proj bias), a batch of
prompts in flight with chunked prefill; an INT8 (RTN) checkpoint at TP 2 against the same checkpoint at TP 1; what
is refused, by name; the default model at TP 3 against HF; and through the real services (a gateway, a decode at
TP 1 and one at TP 2 in a real Redis): a rank of the TP 2 decode killed mid-stream, rank 1 or rank 0, loses no
request (its streams migrate, token-exact) and leaves no rank behind."""
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import psutil
import pytest
import redis
import torch

from tandem.shared.config import CacheConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.parallel.layers import check_tensor_parallel, row_parallel
from tandem.shared.quant.layers import WeightOnlyInt4Linear
from tandem.shared.request import Request, SamplingParams
from tests.prompts import LONG_TEXT, PROMPTS, prompt_token_ids
from tests.tiny_models import NUM_TOKENS, hf_greedy, prompts_for, run, save_tiny

TP2 = ParallelConfig(tensor_parallel_size=2, threads=1, kernel_threads=1)
DEFAULT_MODEL_TOKENS = 12  # greedy tokens of the default model at TP 3 (3 ranks on the test machine's 2 cores)
# name -> (family, config overrides): 4 query heads over 2 KV heads (Qwen2: q/k/v bias); over 1 KV head, which
# both ranks hold (Llama 3 with attention_bias: o_proj's bias added after the all-reduce; tied embeddings)
CHECKPOINTS = {"qwen2-4q-2kv": ("qwen2", {}),
               "llama3-4q-1kv": ("llama3", {"num_key_value_heads": 1, "attention_bias": True})}


def tp_engine(config: ModelConfig, parallel: ParallelConfig | None, chunk: int = 16) -> LLMEngine:
    return LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(chunk, 8), parallel_config=parallel)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tp2_greedy_equals_hf_in_a_batch_with_chunked_prefill(name, tmp_path):
    from transformers import AutoModelForCausalLM

    family, overrides = CHECKPOINTS[name]
    path = save_tiny(family, tmp_path / name, overrides=overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ModelConfig.from_dir(path)
    prompts = prompts_for(1, config.vocab_size)
    expected = {k: hf_greedy(hf, ids, NUM_TOKENS) for k, ids in prompts.items()}
    engine = tp_engine(config, TP2)
    try:
        assert engine.model_runner.kv_caches.shape[4] == max(1, config.num_key_value_heads // 2)
        assert run(engine, prompts) == expected
        assert engine.num_free_blocks == 64
        # a prefix-cache hit (the first 48 tokens' blocks) off a block boundary
        ids = prompts["p70"][:53]
        assert run(engine, {"hit": ids}) == {"hit": hf_greedy(hf, ids, NUM_TOKENS)}
        assert engine.stats().prefix_cache_hits > 0
    finally:
        engine.close()
    assert all(p.poll() == 0 for p in engine.tp_workers.procs)


@pytest.mark.parametrize("bits", [["--bits", "8"], ["--bits", "4", "--group-size", "64"]], ids=["int8", "int4-g64"])
def test_quantized_tp2_equals_tp1(bits, tmp_path):
    """RTN checkpoints: each rank holds its rows (qkv, gate/up, the LM head) or its columns on group boundaries
    (o_proj, down_proj) of the quantized codes; greedy tokens equal the same checkpoint's at TP 1."""
    from tandem.tools.quantize import main

    path, out = save_tiny("qwen2", tmp_path / "qwen2"), tmp_path / "quantized"
    assert main(["--method", "rtn", *bits, "--model", str(path), "--out", str(out)]) == 0
    config = ModelConfig.from_dir(out)
    prompts = prompts_for(2, config.vocab_size)
    expected = run(tp_engine(config, None, chunk=32), prompts)
    engine = tp_engine(config, TP2, chunk=32)
    try:
        assert run(engine, prompts) == expected
    finally:
        engine.close()


def test_refusals_name_what_does_not_split(model_dir, tmp_path):
    default = ModelConfig.from_dir(model_dir)  # SmolLM2-135M: 9 query heads over 3 KV heads
    with pytest.raises(ValueError, match="num_attention_heads 9 of .* is not divisible by 2"):
        check_tensor_parallel(default, 2)
    check_tensor_parallel(default, 3)  # (9 / 3 and 3 / 3 split)
    with pytest.raises(ValueError, match="num_key_value_heads 4 .* neither divides by 3 nor divides it"):
        check_tensor_parallel(replace(default, num_attention_heads=6, num_key_value_heads=4), 3)
    with pytest.raises(ValueError, match="intermediate_size 1536 .* not divisible by 5"):
        check_tensor_parallel(replace(default, num_attention_heads=5, num_key_value_heads=5), 5)

    class Group:
        rank, size = 0, 2

    with pytest.raises(ValueError, match="layers.0.mlp.down_proj: its 64 input columns per rank .* groups of 128"):
        row_parallel(WeightOnlyInt4Linear(256, 8, 128), 64, 128, Group(), "layers.0.mlp.down_proj")
    config = ModelConfig.from_dir(save_tiny("qwen2", tmp_path / "qwen2"))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 does not run with LoRA adapters"):
        LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(16, 8), lora_config=LoRAConfig(), parallel_config=TP2)


@pytest.mark.heavy  # (three ranks loading the 135M model in fp32 on two cores: about 50 s)
def test_the_default_model_at_tp3_equals_hf(model_config, tokenizer, hf_model):
    """SmolLM2-135M in fp32 (its safetensors, as --quantization none serves it): 9 query heads over 3 KV heads
    split at TP 3 (3 query heads and 1 KV head per rank); two prompts in one batch, greedy (EOS held back), equal HF
    fp32's tokens. TP 2 is refused before any rank starts, naming the flag and the field."""
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 2: num_attention_heads 9 of SmolLM2\S* is not "
                                         r"divisible by 2$"):  # fmt: skip
        LLMEngine(model_config, CacheConfig(16, 32), SchedulerConfig(64, 4), parallel_config=TP2)
    prompts = {name: prompt_token_ids(tokenizer, kind, text) for name, kind, text in PROMPTS
               if name in ("capital", "raw_story")}  # fmt: skip
    engine = LLMEngine(model_config, CacheConfig(16, 32), SchedulerConfig(64, 4),
                       parallel_config=replace(TP2, tensor_parallel_size=3))
    try:
        assert engine.model_runner.kv_caches.shape[4] == 1  # (one KV head per rank)
        for name, ids in prompts.items():
            engine.add_request(Request(name, ids, SamplingParams(max_tokens=DEFAULT_MODEL_TOKENS,
                                                                 min_tokens=DEFAULT_MODEL_TOKENS, temperature=0.0)))
        outs = {name: [] for name in prompts}
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
    finally:
        engine.close()
    assert outs == {name: hf_greedy(hf_model, ids, DEFAULT_MODEL_TOKENS) for name, ids in prompts.items()}
    assert all(p.poll() == 0 for p in engine.tp_workers.procs)


# -- a decode at TP 2 in a cluster: its requests outlive the instance -------------------------------------------------
ENGINE = ["--num-blocks", "256", "--threads", "1", "--kernel-threads", "1"]
KILL_TOKENS = 200  # greedy tokens per stream: enough to be mid-stream at the kill


@pytest.fixture(scope="module")
def tp_cluster(model_dir, tmp_path_factory):
    """A tiny Qwen2 (4 query heads over 2 KV heads) with the default model's tokenizer, behind a gateway with one
    decode at TP 1 and a prefill (the prompts are short: decodes compute them); each test adds a decode at TP 2 of
    its own (start_tp2), sends streams and kills a rank. Yields (cluster, its checkpoint, HF's fp32 model, its
    tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.services.launcher import LocalCluster

    path = save_tiny("qwen2", tmp_path_factory.mktemp("tp") / "qwen2", tokenizer_from=model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # (the gateway's tokenizer: this directory's, which transformers loads as Qwen2's; "\n\n" is one token there)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LocalCluster(str(path), prefill_args=ENGINE, decode_args=ENGINE) as cluster:
        yield cluster, path, hf, tokenizer


def start_tp2(cluster, path, tier: str = "decode", args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """python -m tandem.services.<tier> --tensor-parallel-size 2 in the cluster's registry; (its process, its
    address) once it is registered (SERVING: both ranks up). Its log: the cluster's log dir."""
    from tandem.services.launcher import free_port

    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    with open(cluster.log_dir / f"{tier}-tp2-{port}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-P", "-m", f"tandem.services.{tier}", "--model", str(path),
                                 "--host", "127.0.0.1", "--advertise-host", "127.0.0.1", "--port", str(port),
                                 "--metrics-port", str(metrics_port), "--redis-url", cluster.redis_url,
                                 "--tensor-parallel-size", "2", *ENGINE, *args], stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while not cluster.registered_at(address):
        assert proc.poll() is None and time.monotonic() < deadline, f"the TP 2 {tier} did not start: {log.name}"
        time.sleep(0.2)
    return proc, address


def story(i: int) -> str:
    return f"Write a long story about the number {i}."


def stream_request(i: int):
    from tandem.services.client import make_request

    return make_request(story(i), raw=True, max_tokens=KILL_TOKENS, temperature=0.0, ignore_eos=True)


def watch_health(channel, seen: list[str]) -> None:
    """Health.Watch on channel (read as each message comes: a message not read before the call ends is lost)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        for msg in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60):
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(msg.status))
    except grpc.RpcError as e:
        seen.append(e.code().name)


def kill_mid_stream(tp_cluster, kill) -> dict:
    """Streams through the gateway, one at a time until the TP 2 decode (started here) has 2 in flight; then
    kill(its process, its rank 1's psutil.Process). Every stream must end whole, equal to the same request run
    again without a fault, and the ones on the TP 2 decode must have migrated (decode_failed). Returns what the
    caller checks next: proc (exited), rank (rank 1's), key (its registry key), health (what a Health.Watch of it
    opened before the kill saw: statuses, then the call's end)."""
    from tandem.services.client import Completion
    from tandem.v1 import gateway_pb2_grpc
    from tests.integration.helpers import generate_all, load, metric_samples

    cluster, path, hf, tokenizer = tp_cluster
    proc, address = start_tp2(cluster, path)
    (key,) = cluster.registered_at(address)
    (rank,) = psutil.Process(proc.pid).children()
    assert "tandem.services.tp_worker" in " ".join(rank.cmdline())  # (a service's ranks carry the KV transfer)
    results: list[dict] = []
    channel = grpc.insecure_channel(cluster.gateway_address)
    health_channel = grpc.insecure_channel(address)

    def read(i: int) -> None:
        try:
            for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(stream_request(i), timeout=120):
                results[i]["out"].add(msg)
        except grpc.RpcError as e:
            results[i].update(code=e.code(), details=e.details())

    readers: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            held = load(address)
            if held.num_running >= 2 and not held.num_waiting and all(len(r["out"].token_ids) >= 2 for r in results):
                break
            assert time.monotonic() < deadline, ("no 2 streams decoding on the TP 2 decode", held, results)
            if held.num_running + held.num_waiting < 2 and len(readers) < 8:
                results.append(dict(out=Completion()))
                readers.append(threading.Thread(target=read, args=(len(readers),), daemon=True))
                readers[-1].start()
            time.sleep(0.1)
        health: list[str] = []  # what a Health.Watch of the TP 2 decode sees: statuses, then how the call ends
        watcher = threading.Thread(target=watch_health, args=(health_channel, health), daemon=True)
        watcher.start()
        while not health:
            assert watcher.is_alive()
            time.sleep(0.01)
        url = cluster.metrics_urls["gateway"]
        migrations_before = metric_samples(url, "tandem:request_migrations_total")
        running = load(address).num_running
        kill(proc, rank)
        for t in readers:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in readers)
        assert not [r for r in results if "code" in r], "a stream failed"
        # each stream equals the same request run again without a fault (at the TP 1 decode), whose first tokens
        # equal HF fp32's (HF's run of every stream whole would cost more than the rest of the scenario here)
        again = generate_all(cluster.gateway_address, [stream_request(i) for i in range(len(results))])
        for i, (r, out) in enumerate(zip(results, again)):
            assert r["out"].token_ids == out.token_ids and len(out.token_ids) == KILL_TOKENS, i
            assert r["out"].finish_reason == out.finish_reason == "length", i
        ids = tokenizer(story(0), add_special_tokens=False).input_ids
        assert again[0].token_ids[:NUM_TOKENS] == hf_greedy(hf, ids, NUM_TOKENS)
        migrations = {dict(k)["reason"]: v - migrations_before.get(k, 0)
                      for k, v in metric_samples(url, "tandem:request_migrations_total").items()}  # fmt: skip
        assert migrations == {"decode_failed": running}, (migrations, running)
        watcher.join(timeout=30)
        proc.wait(timeout=30)
        return dict(proc=proc, rank=rank, key=key, health=health)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        channel.close()
        health_channel.close()


@pytest.mark.heavy  # (make test kills rank 0 of this decode and rank 1 of a prefill, below: a lost instance's path)
def test_a_killed_rank_1_loses_no_request(tp_cluster):
    """Rank 1 of a decode at TP 2 SIGKILLed mid-stream: the instance is down at once (NOT_SERVING, its record out
    of the registry, every call ended UNAVAILABLE as by a dead process, exit 1, rank 0 ending with a one-line
    error) and its streams go on at the other decode (TP 1), token for token as without the fault."""
    cluster = tp_cluster[0]
    seen = kill_mid_stream(tp_cluster, lambda proc, rank: rank.send_signal(signal.SIGKILL))
    assert seen["proc"].returncode == 1
    assert not redis.Redis.from_url(cluster.redis_url).exists(seen["key"])
    assert seen["health"] == ["SERVING", "NOT_SERVING", "UNAVAILABLE"], seen["health"]


def test_a_killed_rank_0_loses_no_request_and_leaves_no_rank(tp_cluster):
    """Rank 0 (the decode's process) SIGKILLed mid-stream: rank 1 exits with it (PR_SET_PDEATHSIG), the record
    leaves the registry by its TTL as any dead decode's, and the streams go on at the other decode, token for
    token as without the fault."""
    cluster = tp_cluster[0]
    seen = kill_mid_stream(tp_cluster, lambda proc, rank: proc.kill())
    assert seen["proc"].returncode == -signal.SIGKILL
    assert seen["health"] == ["SERVING", "UNAVAILABLE"], seen["health"]
    assert psutil.wait_procs([seen["rank"]], timeout=10)[1] == [], "rank 1 outlived rank 0"
    ttl_ms = redis.Redis.from_url(cluster.redis_url).pttl(seen["key"])
    assert ttl_ms == -2 or 0 < ttl_ms <= 10_000, ttl_ms  # (gone, or going within its TTL)


LONG_PROMPT = "\n\n".join([LONG_TEXT] * 3)  # about 900 tokens: 56 chunks of 16 on the TP 2 prefill


def test_a_killed_rank_of_a_prefill_loses_no_request(tp_cluster):
    """A prefill at TP 2 (16-token chunks) computing long prompts, its rank 1 SIGKILLed mid-prompt: the instance is
    down at once (its record removed, exit 1), and its prompts are placed again on the other prefill (TP 1), as a
    dead prefill's are: every answer equals HF fp32's greedy tokens."""
    from tandem.services.client import generate, make_request
    from tests.integration.helpers import load

    cluster, path, hf, tokenizer = tp_cluster
    proc, address = start_tp2(cluster, path, "prefill", ("--max-num-batched-tokens", "16"))
    (key,) = cluster.registered_at(address)
    (rank,) = psutil.Process(proc.pid).children()
    log_offset = len((cluster.log_dir / "gateway.log").read_text())
    results: list[dict] = []

    def send(i: int) -> None:
        request = make_request(LONG_PROMPT, raw=True, max_tokens=8, temperature=0.0, ignore_eos=True,
                               cache_salt=f"prefill-kill-{i}")  # (no prefix hits steer the routing)
        request.sampling_params.prompt_logprobs = 0  # (through a prefill: only a prefill computes them)
        try:
            results[i]["out"] = generate(cluster.gateway_address, request, timeout=120)
        except grpc.RpcError as e:
            results[i].update(code=e.code(), details=e.details())

    senders: list[threading.Thread] = []
    try:
        while not load(address).num_running:  # one prompt at a time until the TP 2 prefill computes one
            assert len(senders) < 6 and all("code" not in r for r in results), results
            results.append({})
            senders.append(threading.Thread(target=send, args=(len(senders),), daemon=True))
            senders[-1].start()
            started = time.monotonic()
            while not load(address).num_running and time.monotonic() - started < 1:
                time.sleep(0.01)
        rank.send_signal(signal.SIGKILL)
        for t in senders:
            t.join(timeout=120)
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert not any(t.is_alive() for t in senders)
    assert not [r for r in results if "code" in r], results
    expected = hf_greedy(hf, tokenizer(LONG_PROMPT, add_special_tokens=False).input_ids, 8)
    assert [r["out"].token_ids for r in results] == [expected] * len(results)
    assert not redis.Redis.from_url(cluster.redis_url).exists(key)
    assert psutil.wait_procs([rank], timeout=10)[1] == []
    log = (cluster.log_dir / "gateway.log").read_text()[log_offset:]
    assert "placing it again" in log or "migrated in" in log, log[-2000:]
