"""`tandem eval-quant`: KL / top-1 / weight bytes of each quantized format against the float model.

    tandem eval-quant [--json] [--methods fp32,rtn8,rtn4,gptq4,awq4,gguf] [--checkpoint DIR ...]

Prints, for each format, KL(fp32 || quant) of next-token distributions averaged over the positions of
tools/data/quant_eval.txt (at least 2,000 by default), top-1 agreement and weight bytes; with --json:
{"results": [{"method", "bits", "group_size", "kl", "top1", "weight_bytes", ...}, ...]}.
Standalone: python -m tools.eval_quant ... (the tandem CLI wires the same functions). Bad arguments raise
ValueError.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from shared.model_files import packaged_gguf_path
from shared.quant import (QuantConfig, apply_quantization, apply_quantized_state, detect_quant_config,
                          quantize_model, weight_bytes)
from shared.quant.modules import quantizable_linears
from tools.evaluation import (CALIBRATION_TEXT, EVAL_TEXT, compare_to_reference, eval_windows, load_hf_model,
                              reference_logprobs, text_token_ids)
from tools.prepare_model import float_model_dir

DEFAULT_EVAL_METHODS = "fp32,rtn8,rtn8g32,rtn4,gptq4,awq4,gguf"
MIN_REPORT_POSITIONS = 2000


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="float HF-format model directory (default: packaged model)")
    parser.add_argument("--methods", default=DEFAULT_EVAL_METHODS,
                        help="comma list of fp32, rtn8, rtn8g32, rtn4, gptq4, gptq8, awq4, awq8, gguf; a gG "
                             "suffix sets the group size")
    parser.add_argument("--checkpoint", action="append", default=[],
                        help="also evaluate a quantized checkpoint directory or .gguf file (repeatable)")
    parser.add_argument("--gguf", default=None, help="GGUF file for 'gguf' (default: the packaged Q4_1 file)")
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size for rtn4/gptq4/awq4")
    parser.add_argument("--max-positions", type=int, default=2048, help="token positions evaluated (>= 2000)")
    parser.add_argument("--seq-len", type=int, default=512, help="evaluation window length")
    parser.add_argument("--calib-file", default=str(CALIBRATION_TEXT))
    parser.add_argument("--act-order", action="store_true", help="GPTQ entries use act-order")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate each requested format against the float model; print a table or JSON; return 0."""
    if args.max_positions < MIN_REPORT_POSITIONS:
        raise ValueError(f"--max-positions must be at least {MIN_REPORT_POSITIONS}")
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be at least 1, got {args.seq_len}")
    specs = [_parse_method(m, args.group_size) for m in args.methods.split(",") if m.strip()]
    if not specs and not args.checkpoint:
        raise ValueError("nothing to evaluate: --methods lists no format and no --checkpoint is given")
    if args.gguf is not None and Path(args.gguf).suffix != ".gguf":
        raise ValueError(f"--gguf must be a .gguf file, got {args.gguf}")
    gguf = None
    if any(m == "gguf" for m, _, _ in specs):
        gguf = args.gguf or str(packaged_gguf_path())
    sources = args.checkpoint + ([gguf] if gguf else [])
    for source in sources:  # config.json only: fail before loading anything
        if detect_quant_config(source).bits is None:
            raise ValueError(f"{source} is a float checkpoint, not a quantized one")
    model_dir = float_model_dir(args.model)
    # Every checkpoint is loaded (each tensor checked, as the engine would) before minutes of evaluation.
    loaded = {source: _load_checkpoint(model_dir, source) for source in sources}
    windows = eval_windows(text_token_ids(model_dir, EVAL_TEXT), args.seq_len, args.max_positions)
    if windows.numel() < MIN_REPORT_POSITIONS:
        raise ValueError(f"only {windows.numel()} evaluation positions fit; need {MIN_REPORT_POSITIONS}")
    fp32 = load_hf_model(model_dir)
    reference = reference_logprobs(fp32, windows)
    calib = text_token_ids(model_dir, Path(args.calib_file))
    results = []
    for method, bits, group_size in specs:
        if method == "fp32":
            results.append(_row(fp32, method="fp32", bits=None, group_size=None, kl=0.0, top1=1.0,
                                positions=windows.numel(), quantize_s=0.0, eval_s=0.0))
            continue
        if method == "gguf":
            model, config, quantize_s = loaded[gguf]
            bits, group_size = config.bits, config.group_size
        else:
            model, start = load_hf_model(model_dir), time.perf_counter()
            options = {"act_order": True} if args.act_order and method == "gptq" else {}
            apply_quantized_state(model, quantize_model(model, method, bits, group_size, calib, **options))
            quantize_s = time.perf_counter() - start
        results.append(_evaluate(model, (method, bits, group_size), windows, reference, quantize_s=quantize_s))
    for path in args.checkpoint:
        model, config, quantize_s = loaded[path]
        spec = (config.method, config.bits, config.group_size)
        results.append(_evaluate(model, spec, windows, reference, quantize_s=quantize_s) | {"checkpoint": str(path)})
    _print(results, args.json)
    return 0


def _parse_method(name: str, group_size: int) -> tuple[str, int | None, int | None]:
    name = name.strip()
    if name in ("fp32", "gguf"):
        return name, None, None
    match = re.fullmatch(r"(rtn|gptq|awq)(4|8)(?:g(\d+))?", name)
    if match is None:
        raise ValueError(f"unknown eval method {name!r} (use fp32, gguf, or rtn/gptq/awq + 4 or 8 [+ gG])")
    bits = int(match.group(2))
    if match.group(3):
        group_size = int(match.group(3))
    config = QuantConfig(bits=bits, group_size=group_size if bits == 4 or match.group(3) else None,
                         method=match.group(1))
    return config.method, config.bits, config.group_size


def _load_checkpoint(model_dir: Path, source: str):
    """(model with the checkpoint applied, its QuantConfig, load seconds)."""
    model, start = load_hf_model(model_dir), time.perf_counter()
    config = apply_quantization(model, source)
    return model, config, time.perf_counter() - start


def _evaluate(model, spec: tuple[str, int | None, int | None], windows, reference, quantize_s: float) -> dict:
    """spec: (method, bits, group_size)."""
    start = time.perf_counter()
    agreement = compare_to_reference(model, windows, reference)
    method, bits, group_size = spec
    return _row(model, method=method, bits=bits, group_size=group_size, kl=agreement.kl, top1=agreement.top1,
                positions=agreement.num_positions, quantize_s=quantize_s, eval_s=time.perf_counter() - start)


def _row(model, *, method, bits, group_size, kl, top1, positions, quantize_s, eval_s) -> dict:
    linear_bytes = sum(sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
                       for m in quantizable_linears(model).values())
    return {"method": method, "bits": bits, "group_size": group_size, "kl": kl, "top1": top1,
            "weight_bytes": weight_bytes(model), "linear_weight_bytes": linear_bytes, "num_positions": positions,
            "quantize_s": round(quantize_s, 1), "eval_s": round(eval_s, 1)}


def _print(results: list[dict], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"results": results}, indent=2))
        return
    print(f"{'method':<8}{'bits':>5}{'group':>6}{'KL':>12}{'top1':>8}{'weight MiB':>12}{'linear MiB':>12}")
    for r in results:
        print(f"{r['method']:<8}{str(r['bits'] or '-'):>5}{str(r['group_size'] or '-'):>6}{r['kl']:>12.6f}"
              f"{r['top1']:>8.4f}{r['weight_bytes'] / 2**20:>12.1f}{r['linear_weight_bytes'] / 2**20:>12.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.eval_quant",
                                     description="KL / top-1 / bytes of each format vs fp32")
    add_eval_args(parser)
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
