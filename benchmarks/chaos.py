"""Chaos soak: the soak's streams (benchmarks/soak.py) while engine processes are killed with SIGKILL at random
moments and started again, and every answer is checked against the same request run without a fault.

    python -m tandem.benchmarks.chaos                                   # 2 prefill + 2 decode, 16 streams, 300 s
    python -m tandem.benchmarks.chaos --kill prefill,decode,gateway --duration 120 --json chaos.json

Every --kill-every seconds (uniformly jittered by half of it) one process of the --kill tiers is killed (-9) and
started again --restart-after seconds later (LocalCluster.restart: the same flags and port; an engine registers
anew); the next kill comes once it serves again, so at most one process is down at a time. Streams send greedy
requests of the mixed workload one after another (ignore_eos), and a request that fails is not retried: the
count of failed requests is what a client without retries would have seen. After the load, each distinct
prompt answered is run once more on the whole cluster and every answer to it must equal that run, token for
token. Reported: kills by tier, requests done and failed (by status code, and how many failed while a gateway
was down), token-exact answers, migrations and re-placements (from the gateway's log), the time from a
migration's start to its next token (p50, p99), and whether every engine ended idle with all its KV blocks free.
Killing the gateway ends its streams with UNAVAILABLE (nothing keeps a stream whose gateway died); those
failures are reported apart.
"""
from __future__ import annotations

import os

# Killed processes are started again from this one while its stream threads are inside gRPC calls: with gRPC's
# fork handlers on, such a fork can abort the child (an absl mutex check in the handlers); the child only execs.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402

from tandem.benchmarks.soak import build_prompts, percentile, wait_idle  # noqa: E402


@dataclass
class Record:
    """What the streams and the killer saw (appended from their threads; list.append is atomic)."""

    answers: list[tuple[int, list[int]]] = field(default_factory=list)  # (prompt index, token ids) of each done
    # (status code name, a gateway was down, tokens had arrived: a stream cut, not a refused connection)
    failed: list[tuple[str, bool, bool]] = field(default_factory=list)
    kills: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, process name)
    restart_errors: list[str] = field(default_factory=list)  # a killed process that would not start again
    gateway_down: threading.Event = field(default_factory=threading.Event)
    failure_details: dict[str, str] = field(default_factory=dict)  # status code name -> the first one's details


def request_for(prompts: list[tuple[str, int]], index: int):
    from tandem.services.client import make_request

    text, max_tokens = prompts[index]
    return make_request(text, raw=True, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def stream_loop(cluster, prompts, offset: int, end_at: float, record: Record, timeout_s: float) -> None:
    i = offset
    while time.monotonic() < end_at:
        index = i % len(prompts)
        i += 1
        tokens: list[int] = []
        down = record.gateway_down.is_set()
        try:  # (a channel per request: the gateway's port answers again after its restart)
            with grpc.insecure_channel(cluster.gateway_address) as channel:
                from tandem.v1 import gateway_pb2_grpc

                finished = False
                for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request_for(prompts, index),
                                                                          timeout=timeout_s):  # fmt: skip
                    tokens.extend(msg.token_ids)
                    finished = finished or msg.HasField("finish_reason")
            if not finished:
                record.failed.append(("NO_FINISH_REASON", down or record.gateway_down.is_set(), bool(tokens)))
                continue
        except grpc.RpcError as e:
            record.failed.append((e.code().name, down or record.gateway_down.is_set(), bool(tokens)))
            record.failure_details.setdefault(e.code().name, e.details())
            if record.gateway_down.is_set():
                time.sleep(0.5)  # (a client backing off while its gateway restarts)
            continue
        record.answers.append((index, tokens))


def killer(cluster, tiers: tuple[str, ...], every_s: float, restart_after_s: float, started: float, end_at: float,
           record: Record, rng: random.Random) -> None:
    names = [n for n in cluster.processes if n.rstrip("0123456789") in tiers]
    while True:
        time.sleep(every_s * rng.uniform(0.5, 1.5))
        if time.monotonic() >= end_at:
            return
        name = rng.choice(names)
        if name == "gateway":
            record.gateway_down.set()
        cluster.kill(name)
        record.kills.append((time.monotonic(), name))
        print(f"  killed {name} at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        time.sleep(restart_after_s)
        for attempt in range(3):
            try:
                cluster.restart(name)
                break
            except (RuntimeError, TimeoutError) as e:  # (it died starting: its log says why)
                record.restart_errors.append(f"{name}: {e}")
        else:
            return  # (no more kills: the report names the process that stayed down)
        record.gateway_down.clear()


def check_answers(cluster, prompts, record: Record, concurrency: int, timeout_s: float) -> tuple[int, list[int]]:
    """(answers equal to an unfaulted run of their prompt, the prompt indices of those that are not)."""
    from tandem.services.client import generate

    indices = sorted({index for index, _ in record.answers})
    with ThreadPoolExecutor(concurrency) as pool:
        runs = dict(zip(indices, pool.map(lambda k: generate(cluster.gateway_address, request_for(prompts, k),
                                                             timeout=timeout_s).token_ids, indices)))  # fmt: skip
    wrong = [index for index, tokens in record.answers if tokens != runs[index]]
    return len(record.answers) - len(wrong), sorted(set(wrong))


def gateway_log_figures(log_dir: Path) -> dict:
    """Migrations, placements made again and the migration times in the gateway's log(s)."""
    text = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("gateway*.log")))
    resume_ms = [float(m) for m in re.findall(r"migrated in (\d+) ms", text)]
    return {"migrations": len(resume_ms), "migrations_by_reason": {
                reason: text.count(f"({reason})\n") for reason in ("decode_failed", "kv_transfer_failed")},
            "placed_again": text.count("placing it again"),
            "resume_p50_ms": percentile(resume_ms, 50), "resume_p99_ms": percentile(resume_ms, 99)}  # fmt: skip


def run(cluster, prompts, streams: int, duration_s: float, tiers: tuple[str, ...], every_s: float,
        restart_after_s: float, seed: int = 0, timeout_s: float = 300.0) -> dict:
    """The chaos soak on a started cluster (the module's docstring); returns the figures report() prints."""
    record, started = Record(), time.monotonic()
    end_at = started + duration_s
    threads = [threading.Thread(target=stream_loop, args=(cluster, prompts, k * len(prompts) // streams, end_at,
                                                          record, timeout_s), daemon=True)
               for k in range(streams)]  # fmt: skip
    kill_thread = threading.Thread(target=killer, args=(cluster, tiers, every_s, restart_after_s, started, end_at,
                                                        record, random.Random(seed)), daemon=True)  # fmt: skip
    for t in [*threads, kill_thread]:
        t.start()
    for t in threads:
        t.join(timeout=duration_s + timeout_s + 60)
    kill_thread.join(timeout=restart_after_s + 240)
    elapsed = time.monotonic() - started
    engines_after = wait_idle(cluster)
    exact, wrong = check_answers(cluster, prompts, record, min(streams, 16), timeout_s)
    kills: dict[str, int] = {}
    for _, name in record.kills:
        kills[name.rstrip("0123456789")] = kills.get(name.rstrip("0123456789"), 0) + 1
    failed_by_code: dict[str, int] = {}
    for code, *_ in record.failed:
        failed_by_code[code] = failed_by_code.get(code, 0) + 1
    return {"streams": streams, "duration_s": elapsed, "kills": kills, "requests_done": len(record.answers),
            "requests_failed": len(record.failed), "failed_by_code": failed_by_code,
            "first_failure_details": record.failure_details,
            "failed_while_gateway_down": sum(down for _, down, _ in record.failed),
            "failed_mid_stream": sum(cut for *_, cut in record.failed),
            "token_exact": exact, "wrong_prompts": wrong, **gateway_log_figures(cluster.log_dir),
            "restart_errors": record.restart_errors,
            "engines_idle_after": all(l["num_free_blocks"] == l["num_blocks"] and not l["num_running"]
                                      and not l["num_waiting"] for l in engines_after.values()),
            "engines_after": engines_after, "log_dir": str(cluster.log_dir)}  # fmt: skip


def report(r: dict) -> str:
    ms = lambda x: "-" if x is None else f"{x:.0f} ms"  # noqa: E731
    return "\n".join([
        f"chaos: {r['streams']} streams for {r['duration_s']:.0f} s; kills {json.dumps(r['kills'])}",
        f"requests done {r['requests_done']}, failed {r['requests_failed']} {json.dumps(r['failed_by_code'])} "
        f"({r['failed_while_gateway_down']} while a gateway was down; {r['failed_mid_stream']} cut mid-stream, the "
        f"rest refused before their first token)" + "".join(f"\n  first {code}: {details}" for code, details in
                                                           r["first_failure_details"].items()),
        f"token-exact {r['token_exact']} of {r['requests_done']} (prompts answered otherwise: {r['wrong_prompts']})",
        f"migrations {r['migrations']} {json.dumps(r['migrations_by_reason'])}, placed again before the first "
        f"token {r['placed_again']}; migration to next token p50 {ms(r['resume_p50_ms'])}, "
        f"p99 {ms(r['resume_p99_ms'])}",
        f"engines idle with every KV block free afterwards: {r['engines_idle_after']} (logs in {r['log_dir']})",
        f"restarts that failed: {r['restart_errors'] or 0}"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.benchmarks.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--kill", default="prefill,decode", help="tiers whose processes are killed: prefill, decode, "
                   "gateway (default prefill,decode)")  # fmt: skip
    p.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between kills (default 30)")
    p.add_argument("--restart-after", type=float, default=2.0, help="seconds a killed process stays down (default 2)")
    p.add_argument("--prefill", type=int, default=2, help="prefill processes (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode processes (default 2)")
    p.add_argument("--prompts", type=int, default=64, help="distinct seeded prompts cycled through (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: the converted default model)")
    p.add_argument("--engine-args", default="--threads 1", help='flags for each engine (default "--threads 1")')
    p.add_argument("--json", default=None, metavar="FILE", help="write the result here")
    args = p.parse_args(argv)
    tiers = tuple(t.strip() for t in args.kill.split(",") if t.strip())
    if not tiers or set(tiers) - {"prefill", "decode", "gateway"}:
        p.error(f"--kill takes prefill, decode, gateway; got {args.kill!r}")

    from tandem.services.launcher import LocalCluster
    from tandem.shared.model_files import default_model_dir

    print("building prompts...", file=sys.stderr, flush=True)
    prompts = build_prompts(args.model, args.prompts, args.seed)
    engine = args.engine_args.split()
    cluster = LocalCluster(args.model or str(default_model_dir()), num_prefill=args.prefill, num_decode=args.decode,
                           prefill_args=engine, decode_args=engine)  # fmt: skip
    print(f"starting a cluster (logs in {cluster.log_dir})...", file=sys.stderr, flush=True)
    with cluster:
        result = run(cluster, prompts, args.streams, args.duration, tiers, args.kill_every, args.restart_after,
                     args.seed)  # fmt: skip
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    lost = result["requests_failed"] - result["failed_while_gateway_down"]
    bad = lost or result["wrong_prompts"] or result["restart_errors"] or not result["engines_idle_after"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
