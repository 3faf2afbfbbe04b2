"""Weight bytes, prefill tokens/s and single-stream decode tokens/s of the engine for fp32, int8 and int4
weights, in one process on the CPU (or --device cuda).

    python -m benchmarks.quant [--threads 1] [--int8 DIR]   # DIR from `tandem quantize --method rtn --bits 8`

Without --int8 an RTN INT8 checkpoint is written to a temp dir first. INT4 is the packaged Q4_1 GGUF, loaded
natively.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch

from shared.config import CacheConfig, ModelConfig, SchedulerConfig
from shared.engine import LLMEngine
from shared.quant import weight_bytes
from shared.request import Request, SamplingParams
from tools.prepare_model import prepare_model


def measure(config: ModelConfig, device: str, prompt_len: int, decode_tokens: int) -> dict:
    engine = LLMEngine(config, CacheConfig(16, 256, enable_prefix_caching=False), SchedulerConfig(prompt_len, 8), device)
    prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(Request("warm", prompt[:32], SamplingParams(max_tokens=2, temperature=0.0)))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(Request("r", prompt, params))
    t = time.perf_counter()
    engine.step()  # the whole prompt in one step
    prefill_s = time.perf_counter() - t
    t, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return {
        "weight_format": config.weight_format,
        "weight_bytes": weight_bytes(engine.model_runner.model),
        "prefill_tokens_per_s": round(prompt_len / prefill_s, 1),
        "decode_tokens_per_s": round(n / (time.perf_counter() - t), 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--int8", default=None, help="INT8 checkpoint dir (default: write an RTN one)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model()
    int8 = args.int8
    if int8 is None:
        int8 = tempfile.mkdtemp(prefix="tandem-int8-")
        subprocess.run([sys.executable, "-m", "services", "quantize", "--method", "rtn", "--bits", "8",
                        "--out", int8, "--model", str(model_dir)], check=True)  # fmt: skip
    rows = [measure(ModelConfig.from_dir(model_dir, q), args.device, args.prompt_len, args.decode_tokens)
            for q in (None, int8, "gguf")]  # fmt: skip
    base = rows[0]
    for row in rows:
        row["decode_vs_fp32"] = round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
        row["prefill_vs_fp32"] = round(row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2)
    print(json.dumps({"threads": args.threads, "device": args.device, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
