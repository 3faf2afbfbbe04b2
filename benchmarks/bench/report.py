"""The results of a benchmark: the table printed at the end and the JSON document (--json)."""
from __future__ import annotations

import json
from dataclasses import fields

from tandem.benchmarks.bench.metrics import BenchmarkMetrics
from tandem.benchmarks.bench.runner import RunResult

# latencies in ms (median and p99), throughputs per second, goodput in req/s meeting the SLOs
COLUMNS = ("backend", "load", "ok/fail", "req/s", "out tok/s", "vs {baseline}", "TTFT med", "TTFT p99",
           "TPOT med", "TPOT p99", "ITL med", "E2E med", "E2E p99", "goodput")  # fmt: skip


def ratios_to_baseline(runs: list[RunResult], metrics: list[BenchmarkMetrics],
                       baseline: str | None) -> list[float | None]:
    """Each run's output tokens/s over the baseline backend's at the same load level (None without one)."""
    base = {run.load: m.output_throughput for run, m in zip(runs, metrics) if run.backend == baseline}
    return [m.output_throughput / base[run.load] if base.get(run.load) else None for run, m in zip(runs, metrics)]


def token_agreement(runs: list[RunResult], baseline: str | None) -> list[str]:
    """For each other backend's run: how many of its requests generated the very tokens the baseline's run at the
    same load level did (greedy: speculation, chunking and transfer must not change a token), over the requests
    both streamed every id of ('cluster-ngram at concurrency 1: 8/8')."""
    def ids(run: RunResult) -> dict[int, list[int]]:
        return {r.index: r.output_token_ids for r in run.results if r.ok and r.reported_output_tokens is None}

    base = {run.load: ids(run) for run in runs if run.backend == baseline}
    lines = []
    for run in runs:
        if run.backend == baseline or run.load not in base:
            continue
        pairs = [(tokens, base[run.load][i]) for i, tokens in ids(run).items() if i in base[run.load]]
        if pairs:
            same = sum(a == b for a, b in pairs)
            lines.append(f"{run.backend} at {run.load.label}: {same}/{len(pairs)}")
    return lines


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def format_table(runs: list[RunResult], metrics: list[BenchmarkMetrics], ratios: list[float | None],
                 baseline: str | None) -> str:
    """One row per backend and load level; latency columns in ms, goodput in req/s."""
    header = [c.format(baseline=baseline or "baseline") for c in COLUMNS]
    rows = [header]
    for run, m, ratio in zip(runs, metrics, ratios):
        rows.append([run.backend, run.load.label, f"{m.completed}/{m.failed}", f"{m.request_throughput:.2f}",
                     f"{m.output_throughput:.1f}", "-" if ratio is None else f"{ratio:.2f}x",
                     _ms(m.ttft.median), _ms(m.ttft.p99), _ms(m.tpot.median), _ms(m.tpot.p99), _ms(m.itl.median),
                     _ms(m.e2el.median), _ms(m.e2el.p99), f"{m.request_goodput:.2f}"])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def request_record(result) -> dict:
    """One request of a run, for the JSON: lengths, timings in ms, the output token ids, the error if any."""
    ok = result.ok
    return {
        "index": result.index,
        "prompt_len": result.prompt_len,
        "output_tokens": result.num_output_tokens,
        "ttft_ms": result.ttft_s * 1000 if ok else None,
        "tpot_ms": result.tpot_s * 1000 if ok and result.tpot_s is not None else None,
        "e2el_ms": result.e2e_s * 1000 if ok else None,
        "itl_ms": [gap * 1000 for gap in result.itl_s] if ok else [],
        "output_token_ids": result.output_token_ids,
        "error": result.error,
    }


def build_document(args, request_sets, backends: dict[str, dict], runs: list[RunResult],
                   metrics: list[BenchmarkMetrics], ratios: list[float | None], baseline: str | None) -> dict:
    """Everything of a benchmark: the arguments, the workload's lengths (request_sets: one list per load level,
    seeded seed + its position), each backend's set-up (or why it did not run), and per run its load, metrics,
    ratio to the baseline and every request."""
    return {
        "args": {k: _plain(v) for k, v in vars(args).items() if not callable(v)},
        "workload": {
            "name": args.workload,
            "seed": args.seed,
            "num_prompts": args.num_prompts,
            "requests_by_load": [[{"index": r.index, "prompt_len": r.prompt_len, "output_len": r.output_len}
                                  for r in requests] for requests in request_sets],  # fmt: skip
        },
        "baseline": baseline,
        "backends": backends,
        "runs": [
            {"backend": run.backend, "load": run.load.as_json(), **m.as_json(),
             "output_throughput_vs_baseline": ratio, "requests": [request_record(r) for r in run.results]}
            for run, m, ratio in zip(runs, metrics, ratios)
        ],  # fmt: skip
    }


def _plain(value):
    """A JSON-safe form of an argument value (dataclasses become dicts)."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None), dict)) else str(value)


def write_json(document: dict, path: str) -> None:
    """To a file, or to stdout for '-'."""
    text = json.dumps(document, indent=2)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
