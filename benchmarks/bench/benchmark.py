"""One benchmark from start to end: build the workload, run each backend's session in turn, compute the metrics,
print the table, write the JSON and the plots."""
from __future__ import annotations

import asyncio
import signal
import sys

from tandem.benchmarks.bench.backends import create_backend
from tandem.benchmarks.bench.backends.base import first_line
from tandem.benchmarks.bench.metrics import DEFAULT_GOODPUT, BenchmarkMetrics, compute_metrics
from tandem.benchmarks.bench.report import (build_document, format_table, ratios_to_baseline, token_agreement,
                                            write_json)
from tandem.benchmarks.bench.runner import Load, RunResult, run_session
from tandem.benchmarks.bench.workloads import BenchRequest, build_requests


def loads_of(args) -> list[Load]:
    """The load levels the flags ask for, in the order given."""
    if args.concurrency is not None:
        return [Load(concurrency=c) for c in args.concurrency]
    return [Load(request_rate=r, burstiness=args.burstiness or 1.0) for r in args.request_rate]


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_benchmark(args) -> int:
    """Run every backend on the same requests at every load level (args as `tandem bench` parses and check_args
    completes them), then report. Returns 0; 1 when a backend could not run (the others still run and are
    reported); 130 when interrupted (Ctrl-C, SIGTERM: the backends that finished are reported)."""
    import torch
    from transformers import AutoTokenizer

    from tandem.tools.prepare_model import prepare_model

    torch.set_num_threads(args.threads)
    model_dir = str(args.engine_args.model or prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loads = loads_of(args)
    # Each load level gets prompts of its own (seed + its position) and the warm-up one more set's first: no level
    # finds an earlier level's or the warm-up's prompts in a prefix cache (the cluster's, llama-server's slots).
    request_sets = [build_requests(args.workload, tokenizer, args.num_prompts, args.seed + i, args.input_len,
                                   args.output_len) for i in range(len(loads) + 1)]  # fmt: skip
    warmup = request_sets.pop()[0]
    max_request_len = max(r.prompt_len + r.output_len for requests in request_sets for r in requests)
    max_model_len = args.engine_args.create_model_config(model_dir).max_model_len
    if max_request_len >= max_model_len:
        raise ValueError(f"a request needs {max_request_len} tokens; the model's context is {max_model_len}")
    max_in_flight = max(load.concurrency for load in loads) if args.concurrency else args.num_prompts
    slos_ms = dict(args.goodput) if args.goodput else DEFAULT_GOODPUT

    backends: dict[str, dict] = {}  # name -> describe(), or {"error": ...} when it could not run
    runs: list[RunResult] = []
    previous_handler = signal.signal(signal.SIGTERM, _interrupt)  # so that a session stops what it started
    try:
        for name in args.backend:
            try:
                backend = create_backend(name, args, model_dir, max_in_flight, max_request_len)
                backends[name], backend_runs = asyncio.run(run_session(backend, request_sets, loads, args.seed,
                                                                       warmup))  # fmt: skip
            except Exception as e:  # one backend that cannot run must not lose the others' results
                backends[name] = {"error": first_line(e)}
                print(f"{name}: could not run: {first_line(e)}", file=sys.stderr)
                continue
            runs += backend_runs
            if args.json and args.json != "-":  # what has finished survives a later backend that hangs
                write_json(_document(args, request_sets, backends, runs, slos_ms)[0], args.json)
    except KeyboardInterrupt:
        print("\ninterrupted: reporting the backends that finished", file=sys.stderr)
        report(args, request_sets, backends, runs, slos_ms)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    report(args, request_sets, backends, runs, slos_ms)
    return 1 if any("error" in info for info in backends.values()) else 0


def _document(args, request_sets, backends, runs, slos_ms) -> tuple[dict, list[BenchmarkMetrics], list, str | None]:
    """(the JSON document, each run's metrics, each run's ratio to the baseline, the baseline that ran)."""
    metrics = [compute_metrics(run.results, run.duration_s, slos_ms) for run in runs]
    baseline = args.baseline if args.baseline in {run.backend for run in runs} else None
    ratios = ratios_to_baseline(runs, metrics, baseline)
    return build_document(args, request_sets, backends, runs, metrics, ratios, baseline), metrics, ratios, baseline


def report(args, request_sets: list[list[BenchRequest]], backends: dict[str, dict], runs: list[RunResult],
           slos_ms: dict[str, float]) -> None:
    """Print the table (to stderr when the JSON goes to stdout), then write --json and --plot. request_sets: each
    load level's requests."""
    document, metrics, ratios, baseline = _document(args, request_sets, backends, runs, slos_ms)
    out = sys.stderr if args.json == "-" else sys.stdout
    requests = [r for requests in request_sets for r in requests]
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    print(f"\nworkload {args.workload}: {args.num_prompts} requests per load level (prompts of its own), mean "
          f"{mean_in:.0f} prompt + {mean_out:.0f} output tokens, greedy, seed {args.seed}; latencies in ms, goodput "
          f"in req/s meeting "
          + " ".join(f"{k}<={v:g}ms" for k, v in slos_ms.items()), file=out)  # fmt: skip
    if runs:
        print(format_table(runs, metrics, ratios, baseline), file=out)
        weights = {name: info["weights"] for name, info in backends.items() if "weights" in info}
        print("weights: " + ", ".join(f"{name} {w}" for name, w in weights.items()), file=out)
        if agreement := token_agreement(runs, baseline):
            print(f"requests with {baseline}'s very tokens: " + ", ".join(agreement), file=out)
    for run in runs:
        errors = [r.error for r in run.results if r.error]
        if errors:
            print(f"{run.backend} {run.load.label}: {len(errors)} failed, first: {errors[0]}", file=out)
    if args.json:
        write_json(document, args.json)
    if args.plot and runs:
        from tandem.benchmarks.bench.plots import write_plots

        paths = write_plots(runs, metrics, args.plot)
        print(f"plots: {', '.join(str(p) for p in paths)}", file=out)
