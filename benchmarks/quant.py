"""Weight bytes, prefill tokens/s and single-stream decode tokens/s of the engine for fp32, int8 and int4
weights, in one process on the CPU (or --device cuda).

    python -m tandem.benchmarks.quant [--threads 1] [--int8 DIR]   # DIR from `tandem quantize --method rtn --bits 8`

Without --int8 an RTN INT8 checkpoint is written to a temp dir first. INT4 is the packaged Q4_1 GGUF, loaded
natively.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import torch

from tandem.shared.config import ModelConfig
from tandem.tools.evaluation import engine_speed
from tandem.tools.prepare_model import prepare_model


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
        subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", "--bits", "8",
                        "--out", int8, "--model", str(model_dir)], check=True)  # fmt: skip
    rows = [engine_speed(ModelConfig.from_dir(model_dir, q), args.device, args.prompt_len, args.decode_tokens)
            for q in (None, int8, "gguf")]  # fmt: skip
    base = rows[0]
    for row in rows:
        row["decode_vs_fp32"] = round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
        row["prefill_vs_fp32"] = round(row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2)
    print(json.dumps({"threads": args.threads, "device": args.device, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
