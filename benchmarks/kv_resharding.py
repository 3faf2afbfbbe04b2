"""The transfer time of a prompt's KV between tiers of different tensor-parallel sizes (docs/parallelism.md,
"Prefill and decode of different sizes"): prefill TP 1 or 2 -> decode TP 1 or 2, all four pairs in one run, as
ratios against TP 1 -> TP 1.

    python -P -m tandem.benchmarks.kv_resharding --prompt-len 1024 --repeats 15 --json kv.json

Four engine services run at once (prefill TP 1 and 2, decode TP 1 and 2; each rank 1 torch and kernel thread,
registered in a Redis of the benchmark's own) on a random fp32 Llama written here (8 layers, 8 KV heads of 64: 32
KiB of KV per token, 32 MiB for 1024 tokens). The benchmark plays the gateway: it reserves the prompt on the
decode (Generate, max_tokens 1), calls Prefill with the decode's address, size and rank endpoints from its
registry record, and times from the Prefill call to the end of the decode's stream (the decode ends it once the
whole KV arrived, was checked on every rank and the first token appended). The prefill holds the prompt in its
prefix cache (one warm-up call) and the decodes run without prefix caching, so each timed transfer ships every
block and computes only the prompt's last block. The pairs take turns (one transfer each per round, --repeats
rounds), so a load that drifts over the run weighs on every pair alike; the median per pair.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(vocab_size=49152, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (prefill TP, decode TP); the first is the baseline


def write_checkpoint() -> Path:
    """The random fp32 Llama of CONFIG (written once), with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tandem.shared.model_files import cache_dir, default_model_dir

    out = cache_dir() / "shapes" / "kv-resharding"
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        tmp = out.with_name(out.name + ".tmp")
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).save_pretrained(tmp)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_model_dir() / file, tmp / file)
        tmp.rename(out)
    return out


def start_engines(path: Path, redis_url: str, log_dir: Path, prompt_len: int) -> dict[tuple[str, int], tuple]:
    """{(tier, TP): (process, port)}, each registered."""
    import redis

    from tandem.services.launcher import free_port

    blocks = str(4 * (prompt_len // 16 + 2))
    procs = {}
    for tier in ("prefill", "decode"):
        for tp in (1, 2):
            port = free_port()
            argv = [sys.executable, "-P", "-m", f"tandem.services.{tier}", "--model", str(path), "--port", str(port),
                    "--metrics-port", str(free_port()), "--host", "127.0.0.1", "--advertise-host", "127.0.0.1",
                    "--redis-url", redis_url, "--tensor-parallel-size", str(tp), "--threads", "1",
                    "--kernel-threads", "1", "--num-blocks", blocks, "--max-num-batched-tokens", "256"]
            if tier == "decode":
                argv.append("--no-enable-prefix-caching")  # (every block travels each time)
            log = open(log_dir / f"{tier}-tp{tp}.log", "w")
            procs[(tier, tp)] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), port)
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 300
    while len(client.keys("tandem:instance:*")) < 4:
        for (tier, tp), (proc, _) in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{tier} TP {tp} exited (log: {log_dir})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines not registered after 300 s (logs: {log_dir})")
        time.sleep(0.5)
    return procs


def decode_record(redis_url: str, port: int) -> dict:
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.keys("tandem:instance:decode:*"):
        record = json.loads(client.get(key))
        if record["address"].endswith(f":{port}"):
            return record
    raise LookupError(f"no decode registered on port {port}")


def transfer_s(prefill_port: int, decode: dict, ids: list[int], request_id: str) -> float:
    """One prompt's KV from the prefill to the decode: seconds from the Prefill call to the end of the decode's
    stream (max_tokens 1: it ends once the KV is complete)."""
    import grpc

    from tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    with grpc.insecure_channel(decode["address"]) as d, grpc.insecure_channel(f"127.0.0.1:{prefill_port}") as p:
        request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=ids)
        request.sampling_params.max_tokens, request.sampling_params.temperature = 1, 0.0
        call = decode_pb2_grpc.DecodeStub(d).Generate(request, timeout=300)
        reserved = next(call)
        prefill = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=ids,
                                             decode_address=decode["address"],
                                             decode_instance_id=decode["instance_id"],
                                             num_skip_blocks=reserved.num_skip_blocks,
                                             decode_tensor_parallel_size=decode["tensor_parallel_size"],
                                             decode_kv_endpoints=decode["kv_endpoints"]
                                             if decode["tensor_parallel_size"] > 1 else [])  # fmt: skip
        prefill.sampling_params.max_tokens, prefill.sampling_params.temperature = 1, 0.0
        start = time.perf_counter()
        prefill_pb2_grpc.PrefillStub(p).Prefill(prefill, timeout=300)
        replies = list(call)
        elapsed = time.perf_counter() - start
    assert replies and replies[-1].finish_reason and not replies[-1].error, replies[-1:]
    return elapsed


def main(argv: list[str] | None = None) -> None:
    from tandem.services.launcher import free_port, redis_server_binary

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    path = write_checkpoint()
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-kv-resharding-"))
    redis_port = free_port()
    redis_proc = subprocess.Popen([redis_server_binary(), "--port", str(redis_port), "--bind", "127.0.0.1", "--save",
                                   "", "--appendonly", "no"], stdout=subprocess.DEVNULL)  # fmt: skip
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    procs = {}
    try:
        time.sleep(0.5)
        procs = start_engines(path, redis_url, log_dir, args.prompt_len)
        ids = torch.randint(3, CONFIG["vocab_size"], (args.prompt_len,), generator=torch.Generator().manual_seed(0))
        ids = ids.tolist()
        ends = {(p, d): (procs[("prefill", p)][1], decode_record(redis_url, procs[("decode", d)][1]))
                for p, d in PAIRS}  # fmt: skip
        for (p, d), (prefill_port, decode) in ends.items():
            transfer_s(prefill_port, decode, ids, f"warm-{p}-{d}")  # (the prompt into the prefill's cache)
        times = {pair: [] for pair in PAIRS}
        for i in range(args.repeats):
            for (p, d), (prefill_port, decode) in ends.items():
                times[(p, d)].append(transfer_s(prefill_port, decode, ids, f"r{i}-{p}-{d}"))
        results = {f"P{p}->D{d}": {"median_ms": round(statistics.median(t) * 1000, 1),
                                   "all_ms": [round(x * 1000, 1) for x in t]} for (p, d), t in times.items()}
        base = results["P1->D1"]["median_ms"]
        kv_mib = CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4 * \
            args.prompt_len / 2**20
        print(f"KV of a {args.prompt_len}-token prompt: {kv_mib:.0f} MiB, median of {args.repeats}")
        for pair, r in results.items():
            r["ratio_to_p1_d1"] = round(r["median_ms"] / base, 2)
            print(f"{pair}: {r['median_ms']:.1f} ms, x{r['ratio_to_p1_d1']:.2f} of P1->D1 (all: {r['all_ms']})",
                  flush=True)  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis_proc.terminate()
        redis_proc.wait()


if __name__ == "__main__":
    main()
