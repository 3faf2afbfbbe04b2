"""`tandem quantize`: write a weight-only quantized checkpoint of a float model, or rank its layers by
sensitivity.

    tandem quantize --method rtn|gptq|awq|llmint8 --bits 4|8 [--group-size G] --out DIR [--model DIR]
    tandem quantize --method rtn|gptq --bits 4 (--budget-bytes N | --max-kl X) [--high-precision int8|float] --out DIR
    tandem quantize --analyze --bits 4 [--json]

--analyze prints every linear's sensitivity (KL over calibration windows with only that linear quantized to
the --bits/--group-size format, tools/quant/sensitivity.py), most sensitive first, and a summary per layer type.
--budget-bytes / --max-kl run the same analysis (or read it from --sensitivity FILE, an `--analyze --json` output)
and write a mixed-precision checkpoint: the linears that remove the most KL per byte keep --high-precision, the
rest take the --bits format.
Standalone: python -m tandem.tools.quantize ... (the tandem CLI wires the same functions). Bad arguments raise ValueError.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tandem.shared.quant import QuantConfig, apply_quantized_state, save_quantized, weight_bytes

from tandem.tools.quant import quantize_model
from tandem.shared.quant.modules import quantizable_linears
from tandem.tools.quant.outliers import DEFAULT_MAX_FRACTION, DEFAULT_THRESHOLD
from tandem.tools.evaluation import CALIBRATION_TEXT, load_hf_model, text_token_ids
from tandem.tools.prepare_model import float_model_dir

ANALYSIS_DEFAULTS = {"calib_windows": 4, "calib_seq_len": 128, "calib_seed": 0}


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=("rtn", "gptq", "awq", "llmint8"), default="rtn",
                        help="rtn, gptq, awq, or llmint8 (outlier-aware INT8, LLM.int8()'s decomposition)")
    parser.add_argument("--bits", type=int, choices=(4, 8), required=True)
    parser.add_argument("--group-size", type=int, default=None,
                        help="input channels per scale: INT4 32, 64 or 128 (default 128); INT8 per channel "
                             "(default) or, with rtn, 32 or 64")
    parser.add_argument("--out", default=None, help="output checkpoint directory (new or empty)")
    parser.add_argument("--model", default=None, help="float HF-format model directory (default: packaged model)")
    parser.add_argument("--calib-file", default=str(CALIBRATION_TEXT),
                        help="calibration text for gptq, awq, llmint8 and the sensitivity analysis")
    parser.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    parser.add_argument("--outlier-threshold", type=float, default=None,
                        help=f"llmint8: input channels whose calibration |activation| reaches this stay float "
                             f"(default {DEFAULT_THRESHOLD})")
    parser.add_argument("--outlier-max-fraction", type=float, default=None,
                        help=f"llmint8: at most this share of a linear's input channels stays float (default "
                             f"{DEFAULT_MAX_FRACTION})")
    mixed = parser.add_argument_group("sensitivity analysis and mixed precision")
    mixed.add_argument("--analyze", action="store_true",
                       help="print each linear's sensitivity to the --bits format (no checkpoint is written)")
    mixed.add_argument("--json", action="store_true", help="--analyze: print JSON instead of a table")
    mixed.add_argument("--budget-bytes", type=int, default=None,
                       help="mixed precision: total weight bytes the checkpoint may take")
    mixed.add_argument("--max-kl", type=float, default=None,
                       help="mixed precision: calibration KL (nats per position) the checkpoint must stay within")
    mixed.add_argument("--high-precision", choices=("int8", "float"), default=None,
                       help="format of the linears mixed precision keeps (float: the model's dtype; default int8 "
                            "under --bits 4, float under --bits 8)")
    mixed.add_argument("--sensitivity", default=None,
                       help="mixed precision: reuse this `--analyze --json` output instead of analysing again")
    mixed.add_argument("--calib-windows", type=int, default=None,
                       help=f"analysis: calibration windows (default {ANALYSIS_DEFAULTS['calib_windows']})")
    mixed.add_argument("--calib-seq-len", type=int, default=None,
                       help=f"analysis: tokens per window (default {ANALYSIS_DEFAULTS['calib_seq_len']})")
    mixed.add_argument("--calib-seed", type=int, default=None, help="analysis: seed choosing the windows (default 0)")


def run_quantize(args: argparse.Namespace) -> int:
    """Quantize --model with --method and write a tandem checkpoint to --out (or, with --analyze, print the
    sensitivity ranking); returns the exit code (0)."""
    group_size = args.group_size if args.group_size is not None or args.bits == 8 else 128
    mixed = args.budget_bytes is not None or args.max_kl is not None
    _check_flags(args, mixed)
    config = QuantConfig(bits=args.bits, group_size=group_size, method=args.method)  # validates
    low = config.base_linear_format
    if args.high_precision is None:
        args.high_precision = "int8" if args.bits == 4 else "float"
    if mixed or args.analyze:
        if args.method not in ("rtn", "gptq"):
            raise ValueError(f"the sensitivity analysis and mixed precision take --method rtn or gptq, not "
                             f"{args.method}")
        if mixed and args.high_precision == low:
            raise ValueError(f"--high-precision {args.high_precision} is the --bits format itself; use --bits 4")
    if args.analyze:
        if args.out is not None or mixed:
            raise ValueError("--analyze prints the ranking only: drop --out, --budget-bytes and --max-kl")
        _fill_calibration(args)
        return _analyze(args, low)
    if args.out is None:
        raise ValueError("--out is required (or --analyze)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # never overwrite a model (or its source)
        raise ValueError(f"--out {out} already exists and is not an empty directory; choose a new path")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)  # unwritable paths fail now, not after the calibration
    try:
        model_dir = float_model_dir(args.model)
        start = time.perf_counter()
        model = load_hf_model(model_dir)
        calib = text_token_ids(model_dir, Path(args.calib_file)) if args.method != "rtn" or mixed else None
        layer_formats = _choose_mixed(args, model, calib, low) if mixed else {}
        config = QuantConfig(bits=args.bits, group_size=group_size, method=args.method,
                             layer_formats=tuple(sorted(layer_formats.items())))
        state = quantize_model(model, args.method, args.bits, group_size, calib, layer_formats=layer_formats,
                               **_method_options(args))
        save_quantized(out, state, config, model_dir)
    except BaseException:
        if created:  # leave nothing half-written behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    apply_quantized_state(model, state)
    kept = f", {len(layer_formats)} linears at {args.high_precision}" if layer_formats else ""
    outliers = [t for name, t in state.items() if name.endswith(".outlier_weight")]
    if outliers:
        kept = (f", {sum(t.shape[1] for t in outliers)} outlier input columns in float over {len(outliers)} "
                f"linears ({sum(t.numel() * t.element_size() for t in outliers) / 2**20:.1f} MiB)")
    print(f"wrote {out} ({config.weight_format}{kept}, {weight_bytes(model) / 2**20:.1f} MiB of weights, "
          f"{weight_bytes(model)} bytes) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0


def _check_flags(args: argparse.Namespace, mixed: bool) -> None:
    """Refuse flags that contradict each other or are out of range, before anything is loaded; then fill in the
    defaults of the optional ones (ValueError naming the flag)."""
    analysis = mixed or args.analyze
    unused = [flag for flag, given, used in [
        ("--json", args.json, args.analyze),
        ("--sensitivity", args.sensitivity is not None, mixed),
        ("--high-precision", args.high_precision is not None, mixed),
        ("--outlier-threshold", args.outlier_threshold is not None, args.method == "llmint8"),
        ("--outlier-max-fraction", args.outlier_max_fraction is not None, args.method == "llmint8"),
        *[(f"--{name.replace('_', '-')}", getattr(args, name) is not None, analysis) for name in ANALYSIS_DEFAULTS],
    ] if given and not used]
    if unused:
        raise ValueError(f"{unused[0]} has no effect here: --json goes with --analyze, --sensitivity and "
                         "--high-precision with --budget-bytes/--max-kl, --calib-* with those or --analyze, "
                         "--outlier-* with --method llmint8")
    checks = [("--budget-bytes", args.budget_bytes, lambda v: v > 0),
              ("--max-kl", args.max_kl, lambda v: math.isfinite(v) and v >= 0),
              ("--outlier-threshold", args.outlier_threshold, lambda v: math.isfinite(v) and v > 0),
              ("--outlier-max-fraction", args.outlier_max_fraction, lambda v: 0 <= v <= 1),
              ("--calib-windows", args.calib_windows, lambda v: v >= 1),
              ("--calib-seq-len", args.calib_seq_len, lambda v: v >= 1)]
    for flag, value, ok in checks:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} {value} is out of range")


def _fill_calibration(args: argparse.Namespace, recorded: dict | None = None) -> None:
    """Set the --calib-* flags not given: to the values an analysis file recorded (so its windows are the ones
    measured again), else to ANALYSIS_DEFAULTS."""
    for name, default in ANALYSIS_DEFAULTS.items():
        if getattr(args, name) is None:
            value = (recorded or {}).get(name)
            setattr(args, name, value if isinstance(value, int) and (value >= 1 or name == "calib_seed") else default)


def _method_options(args: argparse.Namespace) -> dict:
    if args.method == "gptq" and args.act_order:
        return {"act_order": True}
    if args.method == "llmint8":
        return {"threshold": DEFAULT_THRESHOLD if args.outlier_threshold is None else args.outlier_threshold,
                "max_fraction": (DEFAULT_MAX_FRACTION if args.outlier_max_fraction is None
                                 else args.outlier_max_fraction)}
    return {}


def _probe(args: argparse.Namespace, model, calib):
    from tandem.tools.quant.sensitivity import SensitivityProbe, calibration_windows

    return SensitivityProbe(model, calibration_windows(calib, args.calib_seq_len, args.calib_windows, args.calib_seed))


def _sensitivities(probe, low: str):
    with tqdm(total=len(probe.linears), desc=f"sensitivity to {low}", unit="linear") as bar:
        return probe.analyze(low, progress=lambda done, total: bar.update(1))


def _choose_mixed(args: argparse.Namespace, model, calib, low: str) -> dict[str, str]:
    """The layer map of a mixed checkpoint (sensitivity.choose_layer_formats), printed with its calibration KL."""
    from tandem.shared.quant import float_tensors
    from tandem.tools.quant.sensitivity import choose_layer_formats

    if args.sensitivity is None:
        _fill_calibration(args)
        probe = _probe(args, model, calib)
        sensitivities = _sensitivities(probe, low)
    else:
        sensitivities, recorded = _read_sensitivities(args.sensitivity, low, quantizable_linears(model))
        _fill_calibration(args, recorded)
        probe = _probe(args, model, calib)
    base_bytes = sum(t.numel() * t.element_size() for t in float_tensors(model).values())
    base_bytes += sum(s.num_bytes for s in sensitivities)

    def measure_kl(promoted: dict[str, str]) -> float:
        return probe.kl_with({name: promoted.get(name, low) for name in probe.linears})[0]

    layer_formats = choose_layer_formats(sensitivities, low, args.high_precision, base_bytes, args.budget_bytes,
                                         args.max_kl, measure_kl)
    print(f"mixed precision: {len(layer_formats)} of {len(sensitivities)} linears at {args.high_precision}, the "
          f"rest {low}; calibration KL {measure_kl(layer_formats):.6f} (all {low}: {measure_kl({}):.6f})",
          file=sys.stderr)
    return layer_formats


def _read_sensitivities(path: str, low: str, linears: dict):
    """(the LinearSensitivity list of an `--analyze --json` output, the calibration settings it recorded),
    checked against the model's linears (name -> nn.Linear): ValueError unless it analysed format low on exactly
    these linears with finite KLs >= 0. Byte counts are recomputed from the model's shapes, not read."""
    from tandem.tools.quant.sensitivity import LinearSensitivity, format_bytes

    try:
        data = json.loads(Path(path).read_text())
        entries = {s["name"]: float(s["kl"]) for s in data["linears"]}
        fmt, count = data.get("format"), len(data["linears"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--sensitivity {path} is not a `tandem quantize --analyze --json` output: {e}") from e
    if fmt != low:
        raise ValueError(f"--sensitivity {path} analysed {fmt}, not {low}")
    if sorted(entries) != sorted(linears) or count != len(linears):
        raise ValueError(f"--sensitivity {path} does not list this model's {len(linears)} linears once each")
    if not all(math.isfinite(kl) and kl >= 0 for kl in entries.values()):
        raise ValueError(f"--sensitivity {path} holds a KL that is negative, NaN or infinite")
    sensitivities = []
    for name, kl in entries.items():
        n, k = linears[name].weight.shape
        _, _, index, kind = name.split(".", 3)
        sensitivities.append(LinearSensitivity(name, kind, int(index), kl, float("nan"), format_bytes(low, n, k),
                                               (n, k)))
    return sensitivities, {name: data.get(name) for name in ANALYSIS_DEFAULTS}


def _analyze(args: argparse.Namespace, low: str) -> int:
    from tandem.shared.quant import float_tensors
    from tandem.tools.quant.sensitivity import format_bytes, summarize_by_kind

    model_dir = float_model_dir(args.model)
    model = load_hf_model(model_dir)
    probe = _probe(args, model, text_token_ids(model_dir, Path(args.calib_file)))
    sensitivities = _sensitivities(probe, low)
    by_kind = summarize_by_kind(sensitivities)
    float_bytes = sum(t.numel() * t.element_size() for t in float_tensors(model).values())
    totals = {fmt: float_bytes + sum(format_bytes(fmt, *s.shape) for s in sensitivities)
              for fmt in dict.fromkeys([low, "int8", "float"])}
    if args.json:
        print(json.dumps({"format": low, "calib_windows": args.calib_windows, "calib_seq_len": args.calib_seq_len,
                          "calib_seed": args.calib_seed, "linears": [vars(s) for s in sensitivities],
                          "by_kind": by_kind, "total_bytes": totals}, indent=2))
        return 0
    print(f"each linear alone at {low} (RTN): KL(fp32 || model) in nats per position and top-1 agreement over "
          f"{args.calib_windows} windows x {args.calib_seq_len} tokens (seed {args.calib_seed}); bytes: the linear at "
          f"{low}. Mixed precision promotes by KL per extra byte.")
    print(f"{'rank':>4}  {'linear':<34}{'KL':>11}{'top1':>8}{'bytes':>10}")
    for rank, s in enumerate(sensitivities, 1):
        print(f"{rank:>4}  {s.name:<34}{s.kl:>11.6f}{s.top1:>8.4f}{s.num_bytes:>10}")
    print(f"\n{'layer type':<20}{'mean KL':>11}{'max KL':>11}{'count':>7}")
    for row in by_kind:
        print(f"{row['kind']:<20}{row['mean_kl']:>11.6f}{row['max_kl']:>11.6f}{row['count']:>7}")
    print("\nweight bytes with every linear at " + ", ".join(f"{fmt}: {n}" for fmt, n in totals.items())
          + " (--budget-bytes lies between the first and the one of --high-precision)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.tools.quantize", description="write a quantized checkpoint")
    add_quantize_args(parser)
    return run_quantize(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
