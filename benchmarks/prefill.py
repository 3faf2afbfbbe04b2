"""Prefill throughput against the matmul ceiling of this CPU, measured in the same run.

    python -m tandem.benchmarks.prefill [--threads 1] [--kernel-threads 1] [--dtype float32] [--chunk 512]
        [--rounds 3] [--attention-baseline]

The ceiling: the model's own linear shapes ([chunk, K] x [K, N] for every projection) run as bare GEMMs in
--dtype, in FLOP/s: the better of torch's F.linear (on --threads) and the dense CPU kernel (kernels/cpu_dense.py,
on --kernel-threads), each reported. The engine: one prompt prefilled in chunks of --chunk tokens
by LLMEngine (the prefill tier's loop), in tokens/s and in FLOP/s of those linears plus causal attention
(QK^T and PV). The ratio says how much of the ceiling the engine reaches; the rest is norms, RoPE, KV writes,
attention running below the GEMM rate, and Python (step_profile --prefill-chunk splits a chunk's step into those).
--attention-baseline times the same engine with prefill attention on torch's path (scaled_dot_product_attention
on one thread) in alternate prompts, for the kernel's speedup measured in one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tandem.tools.prepare_model import prepare_model


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of every linear one token goes through, LM head excluded (fused QKV and gate/up as the engine runs
    them)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_layer = [(qkv, hidden), (hidden, config.num_attention_heads * config.head_dim), (2 * inter, hidden),
                 (hidden, inter)]
    return per_layer * config.num_hidden_layers


def matmul_ceiling(config: ModelConfig, chunk: int, dtype: torch.dtype, repeats: int = 3) -> dict[str, float]:
    """FLOP/s of bare GEMMs over the model's shapes at M = chunk (best of repeats): {"torch": F.linear's,
    "kernel": the dense CPU kernel's (absent when it is not built)}."""
    from tandem.kernels import cpu_ext

    shapes = linear_shapes(config)
    weights = {shape: torch.randn(shape).to(dtype) for shape in set(shapes)}
    x = {k: torch.randn(chunk, k).to(dtype) for _, k in shapes}
    flops = sum(2 * chunk * n * k for n, k in shapes)
    gemms = {"torch": F.linear}
    if cpu_ext.available():
        gemms["kernel"] = lambda a, w: cpu_ext.extension().dense_gemm(a, w, None)
    rates = {}
    for name, gemm in gemms.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for n, k in shapes:
                gemm(x[k], weights[(n, k)])
            best = min(best, time.perf_counter() - t)
        rates[name] = flops / best
    return rates


def engine_prefill(config: ModelConfig, chunk: int, prompt_len: int, rounds: int = 1,
                   attention_baseline: bool = False) -> dict[str, list[float]]:
    """Seconds the engine takes to prefill one prompt of prompt_len tokens in chunks (after a warm-up), rounds
    times: {"engine": [seconds per round]}; with attention_baseline also {"torch attention": [...]}, the same
    engine with the CPU prefill attention kernel switched off (shared/attention.py's torch path), the two
    alternating within each round."""
    from tandem.kernels import cpu_prefill_attention

    block_size = 16
    engine = LLMEngine(config, CacheConfig(block_size, prompt_len // block_size + 8, config.dtype,
                                           enable_prefix_caching=False), SchedulerConfig(chunk, 4))
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    supports = cpu_prefill_attention.supports
    modes = ["engine", "torch attention"] if attention_baseline else ["engine"]
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(rounds + 1):  # (round 0: the warm-up)
        for mode in modes:
            cpu_prefill_attention.supports = supports if mode == "engine" else (lambda *args, **kwargs: False)
            try:
                engine.add_request(Request(f"{mode}-{i}", prompt, params))
                t = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                if i > 0:
                    seconds[mode].append(time.perf_counter() - t)
            finally:
                cpu_prefill_attention.supports = supports
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill step (the prefill tier's default)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--kernel-threads", type=int, default=1, help="the C++ kernels' (the prefill tier's "
                        "default is every CPU; 1 measures one core)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=1, help="prompts timed (medians reported)")
    parser.add_argument("--attention-baseline", action="store_true", help="also time the engine with prefill "
                        "attention on torch's path, alternating with the kernel, and print the ratio")
    args = parser.parse_args(argv)
    from tandem.kernels import cpu_ext

    torch.set_num_threads(args.threads)
    cpu_ext.set_num_threads(args.kernel_threads)
    config = ModelConfig.from_dir(prepare_model(), args.quantization, args.dtype)
    rates = matmul_ceiling(config, args.chunk, getattr(torch, args.dtype))
    ceiling = max(rates.values())
    runs = engine_prefill(config, args.chunk, args.prompt_len, args.rounds, args.attention_baseline)
    seconds = statistics.median(runs["engine"])
    linear_flops = args.prompt_len * sum(2 * n * k for n, k in linear_shapes(config))
    # causal attention: QK^T and PV over about half the context on average, per layer and query head
    attention_flops = (2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
                       * args.prompt_len * args.prompt_len / 2)
    print(json.dumps({
        "threads": args.threads, "kernel_threads": args.kernel_threads, "chunk": args.chunk,
        "prompt_len": args.prompt_len, "weight_format": config.weight_format,
        "matmul_ceiling_gflops": round(ceiling / 1e9, 1),
        **{f"{name}_gemm_gflops": round(rate / 1e9, 1) for name, rate in rates.items()},
        "engine_prefill_tokens_per_s": round(args.prompt_len / seconds, 1),
        "engine_gflops": round((linear_flops + attention_flops) / seconds / 1e9, 1),
        "attention_share_of_flops": round(attention_flops / (linear_flops + attention_flops), 2),
        "fraction_of_ceiling": round((linear_flops + attention_flops) / seconds / ceiling, 2),
        "engine_seconds": [round(t, 3) for t in runs["engine"]],
        **({"torch_attention_tokens_per_s": round(args.prompt_len / statistics.median(runs["torch attention"]), 1),
            "torch_attention_seconds": [round(t, 3) for t in runs["torch attention"]],
            "speedup_over_torch_attention": round(statistics.median(runs["torch attention"]) / seconds, 2)}
           if args.attention_baseline else {}),
    }, indent=2))


if __name__ == "__main__":
    main()
