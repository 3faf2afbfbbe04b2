"""Soak test: N concurrent streams of mixed prompts against one cluster for D seconds, watching every process's
memory.

    python -m tandem.benchmarks.soak                                 # starts a LocalCluster (1 prefill + 1 decode)
    python -m tandem.benchmarks.soak --streams 16 --duration 300 --json soak.json
    python -m tandem.benchmarks.soak --gateway 127.0.0.1:50051       # a running cluster (`make serve`)

Each stream sends one request after another over gRPC (Gateway.Generate), cycling through seeded prompts of
`tandem bench`'s mixed workload (65-540 prompt tokens; 80% of the answers 16 tokens, 20% 128; greedy,
ignore_eos). Reported: requests done and failed (by gRPC status code), output tokens/s, client-side TTFT and ITL
p50/p99, and the RSS of every process (gateway, prefill, decode, redis) sampled every --sample-interval seconds:
at start, max, at the end, and its slope in MB/min over the whole run and over its second half (the first minutes
include warm-up: allocator pools, caches). A leak shows as a second-half slope that stays positive on a long run.
With a cluster of its own, it also checks afterwards that every engine is idle with all its KV blocks free.
Against --gateway, processes are found by their command lines on this machine (or named with --pid NAME=PID).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass
class Totals:
    """What every stream recorded (appended from the stream threads; list.append is atomic)."""

    done: list[float] = field(default_factory=list)  # E2E seconds of each finished request
    failed: dict[str, int] = field(default_factory=dict)  # status code name -> count
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, code: str) -> None:
        with self.lock:
            self.failed[code] = self.failed.get(code, 0) + 1


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def rss_mb(pid: int) -> float | None:
    """VmRSS of pid in MB, None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def find_processes() -> dict[str, int]:
    """{name: pid} of the tandem services and redis-servers running on this machine, by command line."""
    found: dict[str, int] = {}
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        name = None
        for tier in ("gateway", "prefill", "decode"):
            if f"tandem.services.{tier}" in words:
                name = tier
        if words and Path(words[0]).name == "redis-server":
            name = "redis"
        if name:
            count = sum(1 for n in found if n.rstrip("0123456789") == name)
            found[f"{name}{count}" if count or name in ("prefill", "decode") else name] = int(entry.name)
    return found


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt, mr = sum(t for t, _ in points) / n, sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return None if var == 0 else sum((t - mt) * (r - mr) for t, r in points) / var * 60


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], interval_s: float):
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        for name, pid in self.pids.items():
            if (mb := rss_mb(pid)) is not None:
                self.samples[name].append((now, mb))

    def run(self) -> None:
        self.sample()
        while not self.stopped.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)
        self.sample()

    def summary(self) -> dict[str, dict]:
        out = {}
        for name, points in self.samples.items():
            if not points:
                continue
            half = points[0][0] + (points[-1][0] - points[0][0]) / 2
            out[name] = {"pid": self.pids[name], "start_mb": points[0][1], "max_mb": max(r for _, r in points),
                         "end_mb": points[-1][1], "slope_mb_per_min": slope_mb_per_min(points),
                         "slope_2nd_half_mb_per_min": slope_mb_per_min([p for p in points if p[0] >= half]),
                         "samples": [(round(t, 1), round(r, 1)) for t, r in points]}  # fmt: skip
        return out


def build_prompts(model: str | None, num: int, seed: int) -> list[tuple[str, int]]:
    """[(raw prompt text, max_tokens)] of the mixed workload (benchmarks/bench/workloads.py)."""
    from transformers import AutoTokenizer

    from tandem.benchmarks.bench.workloads import build_requests
    from tandem.shared.model_files import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(model or default_model_dir())
    return [(r.prompt, r.output_len) for r in build_requests("mixed", tokenizer, num, seed)]


def stream_loop(address: str, prompts: list[tuple[str, int]], offset: int, end_at: float, totals: Totals,
                timeout_s: float) -> None:
    from tandem.services.client import Client, make_request

    i = offset
    with Client(address) as client:
        while time.monotonic() < end_at:
            text, max_tokens = prompts[i % len(prompts)]
            i += 1
            request = make_request(text, raw=True, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            sent = time.perf_counter()
            first = None
            tokens = 0
            gaps: list[float] = []
            last = None
            try:
                finish = None
                for msg in client.stream_request(request, timeout=timeout_s):
                    if msg.token_ids:
                        now = time.perf_counter()
                        if first is None:
                            first = now - sent
                        elif last is not None:
                            gaps.append(now - last)
                        last = now
                        tokens += len(msg.token_ids)
                    if msg.HasField("finish_reason"):
                        finish = msg.finish_reason
            except grpc.RpcError as e:
                totals.fail(e.code().name)
                continue
            if finish is None:
                totals.fail("NO_FINISH_REASON")
                continue
            totals.done.append(time.perf_counter() - sent)
            totals.output_tokens.append(tokens)
            if first is not None:
                totals.ttft_s.append(first)
            totals.itl_s.extend(gaps)


def engine_loads(cluster) -> dict[str, dict]:
    from tandem.v1 import common_pb2, common_pb2_grpc

    loads = {}
    for name, address in cluster.addresses.items():
        if cluster.processes[name].poll() is not None:  # (a process that died: nothing to ask)
            continue
        with grpc.insecure_channel(address) as channel:
            l = common_pb2_grpc.InstanceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
        loads[name] = {"num_blocks": l.num_blocks, "num_free_blocks": l.num_free_blocks,
                       "num_running": l.num_running, "num_waiting": l.num_waiting}  # fmt: skip
    return loads


def wait_idle(cluster, timeout_s: float = 60) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = engine_loads(cluster)
        idle = all(l["num_free_blocks"] == l["num_blocks"] and not l["num_running"] and not l["num_waiting"]
                   for l in loads.values())  # fmt: skip
        if idle or time.monotonic() > deadline:
            return loads
        time.sleep(0.5)


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def report(result: dict) -> str:
    lines = [f"soak: {result['streams']} streams for {result['duration_s']:.0f} s against {result['gateway']}",
             f"requests done {result['requests_done']}, failed {result['requests_failed']} "
             f"{json.dumps(result['failed_by_code']) if result['failed_by_code'] else ''}",
             f"output tokens {result['output_tokens']} ({result['output_tokens_per_s']:.1f} tokens/s), "
             f"requests/s {result['requests_per_s']:.2f}",
             f"TTFT p50 {fmt(result['ttft_p50_s'], 1000, 0)} ms, p99 {fmt(result['ttft_p99_s'], 1000, 0)} ms; "
             f"ITL p50 {fmt(result['itl_p50_s'], 1000, 1)} ms, p99 {fmt(result['itl_p99_s'], 1000, 1)} ms", "",
             f"{'process':10s} {'pid':>7s} {'start MB':>9s} {'max MB':>8s} {'end MB':>8s} {'MB/min':>8s} "
             f"{'MB/min 2nd half':>16s}"]  # fmt: skip
    for name, r in result["rss"].items():
        lines.append(f"{name:10s} {r['pid']:>7d} {r['start_mb']:>9.1f} {r['max_mb']:>8.1f} {r['end_mb']:>8.1f} "
                     f"{fmt(r['slope_mb_per_min'], digits=2):>8s} {fmt(r['slope_2nd_half_mb_per_min'], digits=2):>16s}")
    if result.get("engines_after"):
        lines.append("")
        lines.append("engines after the load: " + ", ".join(
            f"{n} {l['num_free_blocks']}/{l['num_blocks']} blocks free, {l['num_running']} running, "
            f"{l['num_waiting']} waiting" for n, l in result["engines_after"].items()))  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--gateway", default=None, metavar="HOST:PORT", help="target this gateway instead of starting a "
                   "LocalCluster")  # fmt: skip
    p.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples (default 2)")
    p.add_argument("--prompts", type=int, default=256, help="distinct seeded prompts cycled through (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--model", default=None, help="model directory (default: the converted default model)")
    p.add_argument("--prefill", type=int, default=1, help="prefill processes of the cluster it starts")
    p.add_argument("--decode", type=int, default=1, help="decode processes of the cluster it starts")
    p.add_argument("--engine-args", default="--threads 1", help='flags for each engine it starts (default '
                   '"--threads 1")')  # fmt: skip
    p.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="with --gateway: a process to watch (default: found by command line)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result (with every RSS sample) here")
    args = p.parse_args(argv)

    print("building prompts...", file=sys.stderr, flush=True)
    prompts = build_prompts(args.model, args.prompts, args.seed)
    random.Random(args.seed).shuffle(prompts)
    cluster = None
    if args.gateway is None:
        from tandem.services.launcher import LocalCluster
        from tandem.shared.model_files import default_model_dir

        engine = args.engine_args.split()
        cluster = LocalCluster(args.model or str(default_model_dir()), num_prefill=args.prefill,
                               num_decode=args.decode, prefill_args=engine, decode_args=engine)  # fmt: skip
        print(f"starting a cluster (logs in {cluster.log_dir})...", file=sys.stderr, flush=True)
        cluster.start()
        address = cluster.gateway_address
        pids = {name: proc.pid for name, proc in cluster.processes.items()}
    else:
        address = args.gateway
        pids = dict((n, int(v)) for n, v in (item.split("=", 1) for item in args.pid)) or find_processes()
    try:
        sampler = RssSampler(pids, args.sample_interval)
        sampler.start()
        totals = Totals()
        started = time.monotonic()
        end_at = started + args.duration
        threads = [threading.Thread(target=stream_loop, args=(address, prompts, k * len(prompts) // args.streams,
                                                              end_at, totals, args.request_timeout), daemon=True)
                   for k in range(args.streams)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.duration + args.request_timeout + 60)
        elapsed = time.monotonic() - started
        sampler.stop()
        result = {
            "gateway": address, "streams": args.streams, "duration_s": elapsed,
            "requests_done": len(totals.done), "requests_failed": sum(totals.failed.values()),
            "failed_by_code": totals.failed, "output_tokens": sum(totals.output_tokens),
            "output_tokens_per_s": sum(totals.output_tokens) / elapsed, "requests_per_s": len(totals.done) / elapsed,
            "ttft_p50_s": percentile(totals.ttft_s, 50), "ttft_p99_s": percentile(totals.ttft_s, 99),
            "itl_p50_s": percentile(totals.itl_s, 50), "itl_p99_s": percentile(totals.itl_s, 99),
            "e2e_p50_s": percentile(totals.done, 50), "e2e_p99_s": percentile(totals.done, 99),
            "rss": sampler.summary(),
        }  # fmt: skip
        if cluster is not None:
            result["engines_after"] = wait_idle(cluster)
            result["log_dir"] = str(cluster.log_dir)
    finally:
        if cluster is not None:
            cluster.stop()
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["requests_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
