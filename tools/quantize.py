"""`tandem quantize`: write a weight-only quantized checkpoint of a float model.

    tandem quantize --method rtn|gptq|awq --bits 4|8 [--group-size G] --out DIR [--model DIR]

Standalone: python -m tools.quantize ... (the tandem CLI wires the same functions). Bad arguments raise ValueError.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from shared.quant import QuantConfig, apply_quantized_state, quantize_model, save_quantized, weight_bytes
from tools.evaluation import CALIBRATION_TEXT, load_hf_model, text_token_ids
from tools.prepare_model import float_model_dir


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=("rtn", "gptq", "awq"), required=True)
    parser.add_argument("--bits", type=int, choices=(4, 8), required=True)
    parser.add_argument("--group-size", type=int, default=None,
                        help="input channels per scale: INT4 32, 64 or 128 (default 128); INT8 per channel "
                             "(default) or, with rtn, 32 or 64")
    parser.add_argument("--out", required=True, help="output checkpoint directory (new or empty)")
    parser.add_argument("--model", default=None, help="float HF-format model directory (default: packaged model)")
    parser.add_argument("--calib-file", default=str(CALIBRATION_TEXT), help="calibration text for gptq/awq")
    parser.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")


def run_quantize(args: argparse.Namespace) -> int:
    """Quantize --model with --method and write a tandem checkpoint to --out; returns the exit code (0)."""
    group_size = args.group_size if args.group_size is not None or args.bits == 8 else 128
    config = QuantConfig(bits=args.bits, group_size=group_size, method=args.method)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never overwrite a model (or its source)
        raise ValueError(f"--out {out} already exists and is not an empty directory; choose a new path")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # unwritable paths fail now, not after the calibration
    try:
        model_dir = float_model_dir(args.model)
        start = time.perf_counter()
        model = load_hf_model(model_dir)
        calib = text_token_ids(model_dir, Path(args.calib_file)) if args.method != "rtn" else None
        options = {"act_order": True} if args.act_order and args.method == "gptq" else {}
        state = quantize_model(model, args.method, args.bits, group_size, calib, **options)
        save_quantized(out, state, config, model_dir)
    except BaseException:
        if created:  # leave nothing half-written behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    apply_quantized_state(model, state)
    print(f"wrote {out} ({config.weight_format}, {weight_bytes(model) / 2**20:.1f} MiB of weights) "
          f"in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quantize", description="write a quantized checkpoint")
    add_quantize_args(parser)
    return run_quantize(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
