"""Real-size check: checkpoints shaped like the models users bring (random weights that transformers writes, bf16,
nothing downloaded), loaded by one engine as a decode tier loads them, then served through a local cluster.

    python -m tandem.benchmarks.model_shapes --shapes llama-3.2-1b,qwen2.5-1.5b --json shapes.json

Per shape it prints: the load time (ModelConfig + weights, in-process), the process's resident memory after
loading (with the KV pool allocated), the KV pool --memory-utilization gives (blocks, tokens, GB), decode tokens/s
of greedy requests at each --batch-sizes (prompts of --prompt-len tokens, --max-tokens each, the rate over the steps after every request has
its first token; the baseline: HF transformers' generate on the same checkpoint in bf16, batch 1, its decode
tokens/s from the time of --max-tokens + 1 tokens less that of 1; the floor: the measured copy bandwidth over the
weight bytes, the tokens/s of a batch-1 decode that only reads every weight once), and the time to first token and tokens of one
prompt served through a cluster (gateway,
prefill, decode, Redis; --cluster-memory-utilization per tier). The checkpoint is written once under
~/.cache/tandem/shapes/<shape> with the default model's tokenizer (ids past its vocabulary detokenize to "").
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from tandem.shared.model_files import cache_dir, default_model_dir

# the published configs' shapes (config.json of meta-llama/Llama-3.2-1B and Qwen/Qwen2.5-1.5B)
SHAPES = {
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def write_checkpoint(shape: str) -> Path:
    """The shape's random bf16 checkpoint (made once), with the default model's tokenizer files."""
    import transformers
    from transformers import AutoModelForCausalLM

    out = cache_dir() / "shapes" / shape
    if (out / "config.json").exists():
        return out
    class_name, args = SHAPES[shape]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**args), dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir() / file).exists():
            shutil.copy(default_model_dir() / file, tmp / file)
    tmp.rename(out)
    return out


def resident_gb() -> float:
    """This process's resident memory now (VmRSS of /proc/self/status, Linux), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure_engine(path: Path, memory_utilization: float, batch_sizes: list[int], prompt_len: int,
                   max_tokens: int) -> dict:
    from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine

    start = time.perf_counter()
    config = ModelConfig.from_dir(path, dtype="bfloat16")
    engine = LLMEngine(config, CacheConfig(16, None, "bfloat16", memory_utilization), SchedulerConfig(512, 64))
    load_s = time.perf_counter() - start
    cache = engine.cache_config
    # (tied embeddings once: a decode token reads the matrix as the LM head, and one row of it as its embedding)
    tensors = {t.data_ptr(): t for t in engine.model_runner.model.state_dict().values()}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    result = {"model_id": config.model_id, "load_s": round(load_s, 1), "rss_after_load_gb": round(resident_gb(), 2),
              "weight_gb": round(weight_bytes / 1e9, 2),
              "kv_blocks": cache.num_blocks, "kv_tokens": cache.num_blocks * cache.block_size,
              "kv_pool_gb": round(cache.num_blocks * cache.block_bytes(config) / 1e9, 2), "decode_tok_s": {}}
    result["decode_tok_s"] = engine_decode_tok_s(engine, batch_sizes, prompt_len, max_tokens, 40000)
    return result


def engine_decode_tok_s(engine, batch_sizes: list[int], prompt_len: int, max_tokens: int,
                        max_token_id: int) -> dict[int, float]:
    """{batch size: decode tokens/s} of an LLMEngine: per batch size, that many random prompts of prompt_len ids
    below max_token_id (seeded), greedy, max_tokens each; timed from every request's first token to the last."""
    from tandem.shared.request import Request, SamplingParams

    g, rates = torch.Generator().manual_seed(0), {}
    for batch in batch_sizes:
        requests = [Request(f"b{batch}-{i}", torch.randint(100, max_token_id, (prompt_len,), generator=g).tolist(),
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                    for i in range(batch)]  # fmt: skip
        for r in requests:
            engine.add_request(r)
        while any(not r.output_token_ids for r in requests):
            engine.step()
        start, before = time.perf_counter(), sum(len(r.output_token_ids) for r in requests)
        while engine.has_unfinished_requests():
            engine.step()
        tokens = sum(len(r.output_token_ids) for r in requests) - before
        rates[batch] = round(tokens / (time.perf_counter() - start), 2)
    return rates


def memory_bandwidth_gb_s(threads: int, gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Measured copy bandwidth, GB/s (bytes read + written per second; STREAM's copy kernel, the best of
    `repeats` copies of a `gigabytes` fp32 array, with torch on `threads` threads)."""
    torch.set_num_threads(threads)
    src = torch.ones(int(gigabytes * 1e9 / 4))
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return round(2 * src.numel() * 4 / best / 1e9, 1)


def hf_decode_tok_s(path: Path, prompt_len: int, max_tokens: int) -> float:
    """HF transformers' greedy decode tokens/s at batch 1 on the checkpoint in bf16 (the baseline)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, 40000, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    def seconds(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    seconds(1)  # (warm-up)
    return round(max_tokens / (seconds(max_tokens + 1) - seconds(1)), 2)


def serve_one(path: Path, memory_utilization: float, threads: int) -> dict:
    from tandem.services.client import generate, make_request
    from tandem.services.launcher import LocalCluster

    dtypes = ["--dtype", "bfloat16", "--kv-dtype", "bfloat16"]  # (the gateway's too: the model id names them)
    args = dtypes + ["--memory-utilization", str(memory_utilization), "--threads", str(threads)]
    start = time.perf_counter()
    with LocalCluster(str(path), prefill_args=args, decode_args=args,
                      gateway_args=dtypes + ["--local-prefill-tokens", "0"]) as cluster:  # fmt: skip
        up_s = time.perf_counter() - start
        out = generate(cluster.gateway_address, make_request("The history of the printing press " * 20, raw=True,
                                                             max_tokens=16, temperature=0.0), timeout=600)
    return {"cluster_up_s": round(up_s, 1), "ttft_ms": round(out.ttft_ms, 1), "tokens": len(out.token_ids)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,qwen2.5-1.5b", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--memory-utilization", type=float, default=0.3)
    parser.add_argument("--cluster-memory-utilization", type=float, default=0.1)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-cluster", action="store_true", help="skip the cluster run")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    from tandem.kernels import cpu_ext

    torch.set_num_threads(args.threads)
    cpu_ext.set_num_threads(args.threads)  # (a decode engine's kernel threads: every CPU by default)
    results = {}
    for shape in args.shapes.split(","):
        path = write_checkpoint(shape)
        results[shape] = measure_engine(path, args.memory_utilization, [int(b) for b in args.batch_sizes.split(",")],
                                        args.prompt_len, args.max_tokens)  # fmt: skip
        results[shape]["hf_decode_tok_s_batch1"] = hf_decode_tok_s(path, args.prompt_len, args.max_tokens)
        # the batch-1 floor: every weight byte read once per token at the measured bandwidth
        bandwidth = results[shape]["copy_bandwidth_gb_s"] = memory_bandwidth_gb_s(args.threads)
        results[shape]["bandwidth_floor_tok_s"] = round(bandwidth / results[shape]["weight_gb"], 2)
        if not args.no_cluster:
            results[shape] |= serve_one(path, args.cluster_memory_utilization, args.threads)
        print(shape, json.dumps(results[shape]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
