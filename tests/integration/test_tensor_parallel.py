"""Tensor parallelism (docs/parallelism.md, shared/parallel/): an engine of 2 ranks over gloo on CPU (rank 0 here,
rank 1 a process it starts), greedy in fp32 token for token against HF transformers on tiny checkpoints whose heads
divide (4 query heads over 2 KV heads, and over 1 KV head replicated on both ranks, with o_proj bias), a batch of
prompts in flight with chunked prefill; an INT8 (RTN) checkpoint at TP 2 against the same checkpoint at TP 1; what
is refused, by name; and through the real service: a decode process at TP 2 serving over gRPC, then its rank 1
killed mid-stream takes the instance down (the stream fails, the process exits non-zero, no rank is left)."""
import signal
import subprocess
import sys
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
from tests.tiny_models import NUM_TOKENS, hf_greedy, prompts_for, run, save_tiny

TP2 = ParallelConfig(tensor_parallel_size=2, threads=1, kernel_threads=1)
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
    with pytest.raises(ValueError, match="does not run with the prefill tier"):
        LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(16, 8), export_kv=True, parallel_config=TP2)


def test_a_decode_at_tp2_serves_then_a_killed_rank_takes_it_down(model_dir, tmp_path):
    """python -m tandem.services.decode --tensor-parallel-size 2: registered and SERVING once both ranks are up, a
    request computed and streamed over gRPC equals HF; then rank 1 SIGKILLed mid-stream: the stream ends in an
    error (no hang), the record leaves the registry, the process exits non-zero, and no rank is left behind."""
    from transformers import AutoModelForCausalLM

    from tandem.services.launcher import free_port
    from tandem.v1 import decode_pb2, decode_pb2_grpc
    from tests.integration.helpers import RedisServer

    path = save_tiny("qwen2", tmp_path / "qwen2", tokenizer_from=model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompts_for(3, 512)["p37"]
    server = RedisServer()
    server.start()
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.services.decode", "--model", str(path), "--port",
                             str(port), "--metrics-port", str(metrics_port), "--redis-url", server.url,
                             "--tensor-parallel-size", "2", "--threads", "1", "--kernel-threads", "1",
                             "--num-blocks", "128"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    client = redis.Redis.from_url(server.url)
    try:
        for line in proc.stdout:  # (the start-up line once both ranks are up and the server is on)
            if " serving " in line:
                break
        assert proc.poll() is None
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 1 and "tandem.shared.parallel.worker" in " ".join(ranks[0].cmdline())
        assert client.keys("tandem:instance:decode:*")

        def request(request_id: str, max_tokens: int):
            r = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=ids, compute_prompt=True)
            r.sampling_params.max_tokens, r.sampling_params.temperature = max_tokens, 0.0
            r.sampling_params.ignore_eos = True
            return r

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            replies = list(stub.Generate(request("whole", NUM_TOKENS), timeout=120))
            assert [t for r in replies for t in r.token_ids] == hf_greedy(hf, ids, NUM_TOKENS)
            call = stub.Generate(request("killed", 900), timeout=120)
            assert next(call).reserved
            assert next(call).token_ids  # decoding now
            ranks[0].send_signal(signal.SIGKILL)
            try:
                errors = [r.error for r in call if r.error]
                assert errors, "the stream ended without an error"
            except grpc.RpcError as e:  # (or the server ended the call)
                assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        assert proc.wait(timeout=60) != 0
        assert not client.keys("tandem:instance:decode:*")
        assert not psutil.pid_exists(ranks[0].pid) or ranks[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        client.close()
        server.stop()
