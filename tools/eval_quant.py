"""`tandem eval-quant`: KL / top-1 / weight bytes (and task score, decode speed) of each quantized format
against the float model.

    tandem eval-quant [--json] [--methods fp32,rtn8,llmint8,rtn4,gptq4,awq4,gguf] [--checkpoint DIR ...]
                      [--tasks] [--decode-speed]

Prints, for each format, KL(fp32 || quant) of next-token distributions averaged over the positions of
tools/data/quant_eval.txt (at least 2,000 by default), top-1 agreement and weight bytes; with --tasks, the
greedy score on the task suite (tools/tasks.py) and how many answers differ from fp32's, with examples; with
--decode-speed, single-stream decode tokens/s of the engine. Rows on the Pareto front of the measured columns
(bytes, KL, tokens/s, task score) are marked. With --json:
{"results": [{"method", "bits", "group_size", "weight_format", "kl", "top1", "weight_bytes", "pareto", ...}]}.
Standalone: python -m tandem.tools.eval_quant ... (the tandem CLI wires the same functions). Bad arguments raise
ValueError.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.shared.config import ModelConfig
from tandem.shared.model_files import packaged_gguf_path
from tandem.shared.quant import (QuantConfig, apply_quantization, apply_quantized_state, detect_quant_config, save_quantized, weight_bytes)
from tandem.tools.quant import quantize_model
from tandem.shared.quant.modules import quantizable_linears
from tandem.tools.evaluation import (CALIBRATION_TEXT, EVAL_TEXT, Agreement, compare_to_reference, engine_speed,
                              eval_windows, load_hf_model, reference_logprobs, text_token_ids)
from tandem.tools.prepare_model import float_model_dir
from tandem.tools.tasks import diff_report, evaluate_tasks, load_tasks

DEFAULT_EVAL_METHODS = "fp32,rtn8,rtn8g32,llmint8,rtn4,gptq4,awq4,gguf"
MIN_REPORT_POSITIONS = 2000


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="float HF-format model directory (default: packaged model)")
    parser.add_argument("--methods", default=DEFAULT_EVAL_METHODS,
                        help="comma list of fp32, rtn8, rtn8g32, llmint8, rtn4, gptq4, gptq8, awq4, awq8, gguf; a gG "
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
    parser.add_argument("--tasks", action="store_true",
                        help="also score the task suite (tools/data/quant_tasks.jsonl) greedy with the engine, and "
                             "report how many answers change against fp32")
    parser.add_argument("--tasks-limit", type=int, default=None, help="--tasks: at most this many items per category")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="--tasks: tokens generated per item")
    parser.add_argument("--diff-examples", type=int, default=3, help="--tasks: changed answers shown per format")
    parser.add_argument("--decode-speed", action="store_true",
                        help="also measure single-stream decode tokens/s of the engine in each format")


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate each requested format against the float model; print a table or JSON; return 0."""
    if args.max_positions < MIN_REPORT_POSITIONS:
        raise ValueError(f"--max-positions must be at least {MIN_REPORT_POSITIONS}")
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be at least 1, got {args.seq_len}")
    for flag, value, least in (("--tasks-limit", args.tasks_limit, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--diff-examples", args.diff_examples, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
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
    tasks = load_tasks(limit_per_category=args.tasks_limit) if args.tasks else None
    model_dir = float_model_dir(args.model)
    # Every checkpoint is loaded (each tensor checked, as the engine would) before minutes of evaluation.
    loaded = {source: _load_checkpoint(model_dir, source) for source in sources}
    windows = eval_windows(text_token_ids(model_dir, EVAL_TEXT), args.seq_len, args.max_positions)
    if windows.numel() < MIN_REPORT_POSITIONS:
        raise ValueError(f"only {windows.numel()} evaluation positions fit; need {MIN_REPORT_POSITIONS}")
    reference = reference_logprobs(load_hf_model(model_dir), windows)
    calib = text_token_ids(model_dir, Path(args.calib_file))
    if tasks is not None and ("fp32", None, None) not in specs:
        specs.insert(0, ("fp32", None, None))  # the reference the output diff compares with
    results, reports = [], []  # reports[i]: the task report of results[i]
    with tempfile.TemporaryDirectory(prefix="tandem-eval-quant-") as scratch:
        for spec in specs + [("checkpoint", path, None) for path in args.checkpoint]:
            model, source, row = _build(spec, model_dir, calib, loaded, gguf, args, Path(scratch))
            start = time.perf_counter()
            agreement = (compare_to_reference(model, windows, reference) if row["method"] != "fp32"
                         else Agreement(kl=0.0, top1=1.0, num_positions=windows.numel()))
            row |= {"kl": agreement.kl, "top1": agreement.top1, "num_positions": agreement.num_positions,
                    "eval_s": round(time.perf_counter() - start, 1)} | _bytes(model)
            del model
            if args.decode_speed or tasks is not None:
                config = ModelConfig.from_dir(model_dir, source)
                if args.decode_speed:
                    row["decode_tokens_per_s"] = engine_speed(config, decode_tokens=64)["decode_tokens_per_s"]
                if tasks is not None:
                    report = evaluate_tasks(config, tasks, args.max_new_tokens, threads=torch.get_num_threads())
                    reports.append(report)
                    row |= {"task_score": report.accuracy, "task_scores": report.category_accuracy,
                            "tasks_tokens_per_s": round(report.output_tokens_per_s, 1)}
            results.append(row)
    for row, report in zip(results, reports):  # fp32 comes first (inserted above when not asked for)
        row["output_diff"] = diff_report(reports[specs.index(("fp32", None, None))], report, args.diff_examples)
    mark_pareto(results)
    _print(results, args.json)
    return 0


def _build(spec, model_dir: Path, calib, loaded: dict, gguf: str | None, args, scratch: Path):
    """(HF model in the format, what ModelConfig.from_dir takes as its quantization (None for fp32), the
    row's identity fields) for spec (method, bits, group_size), ("gguf", ...) or ("checkpoint", path, None)."""
    method, bits, group_size = spec
    if method in ("gguf", "checkpoint"):
        source = gguf if method == "gguf" else bits
        model, config, load_s = loaded[source]
        row = {"method": config.method, "bits": config.bits, "group_size": config.group_size,
               "weight_format": config.weight_format, "quantize_s": round(load_s, 1)}
        return model, source, row | ({"checkpoint": str(source)} if method == "checkpoint" else {})
    model, start = load_hf_model(model_dir), time.perf_counter()
    if method == "fp32":
        return model, None, {"method": "fp32", "bits": None, "group_size": None, "weight_format": "fp32",
                             "quantize_s": 0.0}
    options = {"act_order": True} if args.act_order and method == "gptq" else {}
    state = quantize_model(model, method, bits, group_size, calib, **options)
    apply_quantized_state(model, state)
    config = QuantConfig(bits=bits, group_size=group_size, method=method)
    source = None
    if args.tasks or args.decode_speed:  # the engine loads a checkpoint
        source = save_quantized(scratch / config.weight_format, state, config, model_dir)
    return model, source, {"method": method, "bits": bits, "group_size": group_size,
                           "weight_format": config.weight_format,
                           "quantize_s": round(time.perf_counter() - start, 1)}


def _bytes(model) -> dict:
    linear_bytes = sum(sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
                       for m in quantizable_linears(model).values())
    return {"weight_bytes": weight_bytes(model), "linear_weight_bytes": linear_bytes}


def mark_pareto(rows: list[dict]) -> None:
    """Set row["pareto"]: no other row is at least as good on every measured objective (weight_bytes and kl
    lower, decode_tokens_per_s and task_score higher, each where measured) and better on one."""
    keys = [("weight_bytes", 1), ("kl", 1), ("decode_tokens_per_s", -1), ("task_score", -1)]
    keys = [(k, sign) for k, sign in keys if all(k in row for row in rows)]

    def dominates(a, b):
        return (all(sign * a[k] <= sign * b[k] for k, sign in keys)
                and any(sign * a[k] < sign * b[k] for k, sign in keys))

    for row in rows:
        row["pareto"] = not any(dominates(other, row) for other in rows if other is not row)


def _parse_method(name: str, group_size: int) -> tuple[str, int | None, int | None]:
    name = name.strip()
    if name in ("fp32", "gguf"):
        return name, None, None
    if name == "llmint8":
        return "llmint8", 8, None
    match = re.fullmatch(r"(rtn|gptq|awq)(4|8)(?:g(\d+))?", name)
    if match is None:
        raise ValueError(f"unknown eval method {name!r} (use fp32, gguf, llmint8, or rtn/gptq/awq + 4 or 8 [+ gG])")
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


def _print(results: list[dict], as_json: bool) -> None:
    """The table: weight bytes (all, and the quantizable linears alone), KL, top-1; with --tasks the score, the
    answers that differ from fp32's (right->wrong / wrong->right) and the score per category; with
    --decode-speed tokens/s; "*" on the Pareto front. Then each format's changed answers, with whether each was
    right."""
    if as_json:
        print(json.dumps({"results": results}, indent=2))
        return
    tasks = "task_score" in results[0]
    speed = "decode_tokens_per_s" in results[0]
    categories = list(results[0].get("task_scores", {}))
    print(f"{'format':<28}{'weight MiB':>11}{'linear MiB':>11}{'KL':>10}{'top1':>8}"
          + (f"{'task':>7}  {'changed (r->w/w->r)':<21}" + "".join(f"{c[:6]:>7}" for c in categories) if tasks else "")
          + (f"{'tok/s':>8}" if speed else "") + "  pareto")
    for r in results:
        name = r["weight_format"] + (f" ({Path(r['checkpoint']).name})" if "checkpoint" in r else "")
        line = (f"{name:<28}{r['weight_bytes'] / 2**20:>11.1f}{r['linear_weight_bytes'] / 2**20:>11.1f}"
                f"{r['kl']:>10.5f}{r['top1']:>8.4f}")
        if tasks:
            diff = r["output_diff"]
            changed = f"{diff['num_changed']}/{diff['num_items']} ({diff['correct_to_wrong']}/{diff['wrong_to_correct']})"
            line += f"{r['task_score']:>7.3f}  {changed:<21}" + "".join(f"{r['task_scores'][c]:>7.2f}" for c in categories)
        if speed:
            line += f"{r['decode_tokens_per_s']:>8.1f}"
        print(line + ("  *" if r["pareto"] else ""))
    for r in results if tasks else ():
        examples = r["output_diff"]["examples"]
        if examples:
            print(f"\n{r['weight_format']}: {r['output_diff']['num_changed']} of {r['output_diff']['num_items']} "
                  f"answers differ from fp32, e.g.")
        for ex in examples:
            marks = ["right" if ex[k] else "wrong" for k in ("reference_correct", "output_correct")]
            print(f"  [{ex['id']}] {ex['prompt']!r}\n    fp32 ({marks[0]}): {ex['reference']!r}\n"
                  f"    this ({marks[1]}): {ex['output']!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.tools.eval_quant",
                                     description="KL / top-1 / bytes of each format vs fp32")
    add_eval_args(parser)
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
