"""Serving benchmark: one stream, then N concurrent streams, through a local cluster; HF transformers fp32
generate on the same prompt as the baseline measured in the same run.

    python -m benchmarks.serving [--gateway HOST:PORT] [--concurrency 8] [--max-tokens 128]

Prints TTFT, TPOT, ITL and output tokens/s (median over requests) and the ratio to the HF baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from services.client import generate, make_request

PROMPT = "Explain how a bicycle works, part by part, for a curious ten-year-old."


def hf_baseline(model_dir: str, max_tokens: int, threads: int) -> float:
    """HF transformers fp32 greedy generate, single stream: output tokens/s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                return_dict=False)])  # fmt: skip
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        elapsed = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) / elapsed


def run(address: str, concurrency: int, max_tokens: int) -> dict:
    request = make_request(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda _: generate(address, request, timeout=900), range(concurrency)))
    wall = time.perf_counter() - t
    tokens = sum(o.completion_tokens for o in outs)
    tpot = [(o.e2e_ms - o.ttft_ms) / max(1, o.completion_tokens - 1) for o in outs]
    return {
        "concurrency": concurrency,
        "ttft_ms_median": round(statistics.median(o.ttft_ms for o in outs), 1),
        "tpot_ms_median": round(statistics.median(tpot), 1),
        "itl_ms_p50": round(statistics.median(x for o in outs for x in o.itl_ms), 1),
        "output_tokens_per_s": round(tokens / wall, 1),
        "per_stream_tokens_per_s": round(statistics.median(1000 / t for t in tpot), 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default=None, help="use a running cluster instead of starting one")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    parser.add_argument("--baseline-threads", type=int, default=2, help="torch threads for HF (the whole machine)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args(argv)
    from services.launcher import LocalCluster
    from tools.prepare_model import prepare_model

    model_dir = str(prepare_model())
    results = {}
    if not args.no_baseline:
        results["hf_transformers_tokens_per_s"] = round(hf_baseline(model_dir, args.max_tokens, args.baseline_threads), 1)
    engine = ["--threads", str(args.threads)]
    cluster = None if args.gateway else LocalCluster(model_dir, prefill_args=engine, decode_args=engine).start()
    address = args.gateway or cluster.gateway_address
    try:
        generate(address, make_request("warm up", max_tokens=4))
        results["single"] = run(address, 1, args.max_tokens)
        results["concurrent"] = run(address, args.concurrency, args.max_tokens)
    finally:
        if cluster:
            cluster.stop()
    if "hf_transformers_tokens_per_s" in results:
        base = results["hf_transformers_tokens_per_s"]
        for key in ("single", "concurrent"):
            results[key]["vs_hf_single_stream"] = round(results[key]["output_tokens_per_s"] / base, 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
