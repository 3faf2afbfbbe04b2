"""`tandem bench` (also `python -m tandem.benchmarks.bench`): a serving benchmark in the vocabulary of vLLM's
`vllm bench serve`, run on several backends with the same generated requests in one run.

    tandem bench --workload decode-heavy --num-prompts 32 --concurrency 1,8,32 --json out.json --plot plots/

Backends run one after another (each one's processes stopped before the next starts), and each runs every load
level in turn. Each load level has prompts of its own (seed + the level's position), the same for every backend,
so a level never finds an earlier one's prompts in a prefix cache; the warm-up request's prompt is none of them.
At the end a table compares the backends, with each one's output tokens/s over the --baseline's at the same load
level.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys

from tandem.benchmarks.bench.backends import BACKENDS, DEFAULT_BACKENDS
from tandem.benchmarks.bench.metrics import DEFAULT_GOODPUT, parse_slo
from tandem.benchmarks.bench.workloads import FIXED_INPUT_LEN, FIXED_OUTPUT_LEN, WORKLOADS

DEFAULT_CONCURRENCY = [1, 8]
DEFAULT_THREADS = 2  # the in-process backends, llama-server and vLLM have the machine to themselves


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of req/s (or inf), got {text!r}") from None
    if not all(v > 0 for v in values):  # also refuses nan
        raise argparse.ArgumentTypeError(f"request rates must be positive, got {text}")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
    return value


def _backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    for name in names:
        if name not in BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a backend is listed twice in {text!r}")
    return names


def _slo(text: str) -> tuple[str, float]:
    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _EngineFlagParser(argparse.ArgumentParser):
    """Parses --engine-args' string; its errors become the outer flag's error."""

    def error(self, message):
        raise argparse.ArgumentTypeError(message)


def _engine_args(text: str):
    from tandem.services.flags import add_engine_args, apply_env
    from tandem.shared.engine_args import EngineArgs

    parser = _EngineFlagParser(prog="--engine-args", add_help=False)
    add_engine_args(parser)  # no tier: num_blocks and max_num_batched_tokens stay None unless given
    apply_env(parser, shlex.split(text))
    return EngineArgs.from_namespace(parser.parse_args(shlex.split(text)))


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `tandem bench`."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--backend", type=_backends, default=None,
                   help=f"comma list of {', '.join(BACKENDS)} (cluster-METHOD: the cluster with --speculative-method "
                        f"METHOD; default: {','.join(DEFAULT_BACKENDS)}, plus llama-server when its binary is "
                        "found)")  # fmt: skip
    p.add_argument("--baseline", choices=BACKENDS, default=None,
                   help="backend the throughput ratio is taken against (default: hf-static when it runs)")
    p.add_argument("--workload", choices=list(WORKLOADS), default="decode-heavy",
                   help="decode-heavy: prompts 20-60 tokens, 128 out; mixed: prompts 65-540, 80%% 16 out and 20%% "
                        "128; fixed: --input-len / --output-len; copy: a passage of 100-300 tokens then its first 16 "
                        "again, --output-len out (default 40) (default decode-heavy)")  # fmt: skip
    p.add_argument("--num-prompts", type=_positive_int, default=32, help="requests per run (default 32)")
    p.add_argument("--input-len", type=_positive_int, default=None,
                   help=f"fixed workload: prompt tokens (default {FIXED_INPUT_LEN})")
    p.add_argument("--output-len", type=_positive_int, default=None,
                   help=f"fixed and copy workloads: output tokens (default {FIXED_OUTPUT_LEN}; copy 40)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, lengths and arrival times (default 0)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_positive_ints, default=None,
                      help="closed loop: requests in flight; a comma list runs each level in turn "
                           f"(default {','.join(map(str, DEFAULT_CONCURRENCY))})")  # fmt: skip
    load.add_argument("--request-rate", type=_rates, default=None,
                      help="open loop: arrivals per second (inf: all at once); a comma list runs each in turn")
    p.add_argument("--burstiness", type=_positive_float, default=None,
                   help="with --request-rate: shape of the gamma-distributed gaps (1 = Poisson, the default)")
    p.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs a request must meet to count in goodput: ttft, tpot, e2el in ms (default "
                        + " ".join(f"{k}:{v:g}" for k, v in DEFAULT_GOODPUT.items()) + ")")  # fmt: skip
    p.add_argument("--gateway", default=None, help="cluster: HOST:PORT of a running gateway (default: start one)")
    p.add_argument("--engine-args", type=_engine_args, default="",
                   help="engine flags of the cluster's prefill and decode and of the colocated engine, as one string,"
                        ' e.g. "--quantization gguf --num-blocks 512" (python -m tandem.services.decode --help); the '
                        "cluster's processes take --threads from here (default 1 each)")  # fmt: skip
    p.add_argument("--threads", type=_positive_int, default=DEFAULT_THREADS,
                   help=f"threads of the one-process backends: colocated, hf-static, llama-server, vllm (default "
                        f"{DEFAULT_THREADS})")  # fmt: skip
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)")
    p.add_argument("--llama-threads", type=_positive_int, default=None,
                   help="llama-server's -t (default: --threads). NOTE: with -t equal to the cores, it ran about 100x "
                        "slower on a 2-core machine while another process was busy (-t 1 did not)")
    p.add_argument("--llama-slots", type=_positive_int, default=None,
                   help="llama-server's parallel slots, -np (default: 32, or the largest concurrency if more)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="vllm backend: the python of a venv with vLLM's CPU build (default: $VLLM_PYTHON); it serves "
                        "the cluster's model directory on cores 0..--threads-1")  # fmt: skip
    p.add_argument("--vllm-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                   help='vllm backend: its --dtype (default bfloat16; compare with --engine-args "--quantization none '
                        '--dtype bfloat16")')  # fmt: skip
    p.add_argument("--openai-url", default=None, metavar="URL",
                   help="openai backend: a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vLLM, SGLang, "
                        "TGI, our gateway's HTTP API); requests go to URL/v1/completions")  # fmt: skip
    p.add_argument("--openai-model", default=None, metavar="NAME",
                   help="openai backend: the requests' model (default: the first of URL/v1/models)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, help="seconds per request (600)")
    p.add_argument("--log-dir", default=None, help="logs of the processes started (default: a new temp dir)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every result as JSON to FILE ('-': stdout)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF and throughput PNGs into DIR")


def check_args(args) -> None:
    """Check the flags against each other and fill in the defaults that depend on others. ValueError (or
    FileNotFoundError for a llama-server or vLLM python path that is not an executable) saying what is wrong."""
    from tandem.benchmarks.bench.backends.llama_server import find_llama_server
    from tandem.benchmarks.bench.backends.vllm import find_vllm_python

    if args.workload != "fixed" and args.input_len:
        raise ValueError(f"--input-len sets the fixed workload's prompt length; {args.workload} has its own")
    if args.workload not in ("fixed", "copy") and args.output_len:
        raise ValueError(f"--output-len sets the fixed and copy workloads' output length; {args.workload} has its "
                         "own")
    if args.burstiness is not None and args.request_rate is None:
        raise ValueError("--burstiness shapes the gaps between arrivals: it needs --request-rate")
    llama = find_llama_server(args.llama_server)
    if args.backend is None:
        args.backend = list(DEFAULT_BACKENDS) + (["llama-server"] if llama else [])
    if "llama-server" in args.backend and llama is None:
        raise ValueError("backend llama-server: no binary found; pass --llama-server PATH or set $LLAMA_SERVER")
    if "vllm" in args.backend and find_vllm_python(args.vllm_python) is None:
        raise ValueError("backend vllm: no vLLM python found; pass --vllm-python PATH or set $VLLM_PYTHON (the python "
                         "of a venv with vLLM's CPU build: docs/benchmarks.md)")  # fmt: skip
    if "openai" in args.backend and not args.openai_url:
        raise ValueError("backend openai: pass --openai-url URL, the running server it sends its requests to")
    if args.openai_url and "openai" not in args.backend:
        raise ValueError("--openai-url is where the openai backend sends its requests; it is not among the backends")
    if args.gateway and "cluster" not in args.backend:
        raise ValueError("--gateway is where the cluster backend sends its requests; it is not among the backends")
    if args.baseline is None:
        args.baseline = "hf-static" if "hf-static" in args.backend else None
    elif args.baseline not in args.backend:
        raise ValueError(f"--baseline {args.baseline} is not among the backends run ({','.join(args.backend)})")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = list(DEFAULT_CONCURRENCY)


def run_bench(args) -> int:
    """Run the benchmark the parsed flags describe; print the table, write --json and --plot. Returns 0 when
    every backend ran (failed requests are in the results), 1 when one could not, 130 when interrupted."""
    from tandem.benchmarks.bench.benchmark import run_benchmark

    check_args(args)
    return run_benchmark(args)


def main(argv=None) -> None:
    """python -m tandem.benchmarks.bench: the same flags as `tandem bench`."""
    parser = argparse.ArgumentParser(prog="python -m tandem.benchmarks.bench")
    add_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    try:
        sys.exit(run_bench(args))
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {e}")
