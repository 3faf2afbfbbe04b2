"""Faults on a real 2 prefill + 3 decode cluster with a Redis of the test's own (issue 16), each bounded in time:
Redis stopped, and in the long pass also frozen, under load, slow clients (gRPC and HTTP SSE), 200 requests (16
in make test's short pass) cancelled or timed out at random points, a decode frozen mid-stream, one stopped while a
stream outlives its drain, then kill -9 of a decode mid-stream and of each prefill mid-transfer; streams on a decode
that fails migrate (issue 36), and a prompt whose last prefill dies goes to a decode. Make test runs the Redis stop,
the slow clients, the short pass of cancellations and the prefills' kills; the rest is in .ci/run's heavy pass.
Loopback only.

The tests share one cluster and run in file order: the last four stop an instance each (a decode killed, each
prefill killed, then a decode drained, whose prompts the decodes compute: make test runs only the prefills'; the
other two are in the heavy pass). One
file (over 400 lines) for that reason: the process deaths in a module of their own would start a second 2 + 3
cluster, some 15 s of make test's budget.
(A reservation's KV lease while its prompt queues on a busy prefill: test_robustness.py.)
Every call has a timeout and every thread is joined with one, so no test can hang. Measurements (latencies,
RSS, times to resume a migrated stream) are printed: run with -s to see them."""
import json
import random
import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import pytest

from tandem.services.client import Completion, generate, make_request
from tandem.v1 import gateway_pb2, gateway_pb2_grpc
from tests.integration.helpers import (RedisServer, generate_all, greedy_request, load, metric_samples, rss_mb,
                                       tracebacks, wait_idle)
from tests.passes import LONG
from tests.prompts import LONG_TEXT, PROMPTS

LONG_PROMPT = "\n\n".join(f"Part {i + 1}. {LONG_TEXT}" for i in range(5))  # raw, about 1,500 tokens
PREFILL_CHUNK = 64  # --max-num-batched-tokens of the prefills: a long prompt takes ~24 steps, its KV streams meanwhile
SHORT = [(name, kind, text) for name, kind, text in PROMPTS if name != "long_summary"]


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(model_dir, hf_references, redis_server):
    from tandem.services.launcher import LocalCluster

    engine = ["--num-blocks", "320", "--threads", "1"]
    # --local-prefill-tokens 0: every prompt goes through a prefill and its KV over the wire to a decode
    # (3 decodes: the kill test kills one, the drain test (heavy) then stops one of the other two)
    with LocalCluster(str(model_dir), num_prefill=2, num_decode=3, redis_url=redis_server.url, drain_timeout_s=5,
                      prefill_args=engine + ["--max-num-batched-tokens", str(PREFILL_CHUNK)],
                      decode_args=engine,
                      gateway_args=["--local-prefill-tokens", "0"]) as c:
        yield c


def instance_id(cluster, name: str) -> str:
    (key,) = cluster.registered_at(cluster.addresses[name])
    return key.decode().rsplit(":", 1)[1]


def stats(xs: list[float]) -> str:
    if not xs:
        return "none"
    xs = sorted(xs)
    return (f"n={len(xs)} mean={statistics.mean(xs):.2f}s p50={xs[len(xs) // 2]:.2f}s "
            f"p90={xs[int(len(xs) * 0.9)]:.2f}s max={xs[-1]:.2f}s")


def short_requests(hf_references, max_tokens: int):
    return [(greedy_request(kind, text, max_tokens), hf_references[name][1][:max_tokens]) for name, kind, text in SHORT]


# -- c. Redis stopped, then frozen (the long pass), under steady load ------------------------------------------------
@pytest.mark.soak
def test_redis_stopped_or_frozen_fails_no_request(cluster, redis_server, hf_references):
    request, expected = greedy_request("chat", "What is the capital of France?", 8), hf_references["capital"][1][:8]
    phase, records, failures, stop = ["baseline"], [], [], threading.Event()

    def client_loop(k: int) -> None:
        while not stop.is_set():
            started_in, t = phase[0], time.monotonic()
            try:
                out = generate(cluster.gateway_address, request, timeout=60)
                if out.token_ids != expected:
                    failures.append(f"{started_in}: {out.token_ids} != {expected}")
            except grpc.RpcError as e:
                failures.append(f"{started_in}: {e.code().name}: {e.details()}")
            records.append((started_in, phase[0], time.monotonic() - t))

    clients = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(3)]
    for t in clients:
        t.start()
    try:
        time.sleep(3)
        phase[0] = "stopped"
        redis_server.stop()
        time.sleep(12)  # (longer than the registry's 10 s TTL)
        phase[0] = "restarted"
        redis_server.start()  # (empty: the instances publish again at their next heartbeat)
        time.sleep(3)
        if LONG:  # (make test freezes Redis under routing in test_prefix_routing.py, and times a hung one out in
            # test_prefix_index.py)
            phase[0] = "frozen"
            redis_server.pause()
            time.sleep(6)  # (three times the Redis clients' 2 s socket timeout)
            phase[0] = "resumed"
            redis_server.resume()
            time.sleep(3)
    finally:
        redis_server.resume()
        stop.set()
        for t in clients:
            t.join(timeout=90)
    assert not any(t.is_alive() for t in clients), "a client is still waiting 90 s after the last phase"
    print("\nRedis fault: per-request E2E latency by the phase the request started in (3 client threads, 8 tokens)")
    for name in ("baseline", "stopped", "restarted", "frozen", "resumed"):
        print(f"  {name:9s} {stats([d for p, _, d in records if p == name])}")
    spanning = [d for p, q, d in records if p != q]
    print(f"  spanning a phase change: {stats(spanning)}")
    assert not failures, failures
    if LONG:
        assert len([r for r in records if r[0] == "frozen"]) >= 3, "almost no request ran while Redis was frozen"


# -- d. slow clients ------------------------------------------------------------------------------------------------
UNREAD_S = 8  # how long the slow clients read nothing (the decode streams hundreds of tokens to the gRPC one meanwhile)


def test_a_slow_client_holds_up_no_one_and_buffering_is_bounded(cluster, hf_references):
    pid = cluster.processes["gateway"].pid
    samples, sampling = [(0.0, rss_mb(pid))], threading.Event()
    t0 = time.monotonic()

    def sample_rss() -> None:
        while not sampling.wait(0.5):
            samples.append((time.monotonic() - t0, rss_mb(pid)))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    base_url = cluster.openai_base_url
    model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]
    channel = grpc.insecure_channel(cluster.gateway_address)
    http = httpx.Client(timeout=httpx.Timeout(120))
    try:
        slow_grpc = gateway_pb2_grpc.GatewayStub(channel).Generate(
            make_request("Tell me a very long story about a dragon.", max_tokens=2000, temperature=0.0,
                         ignore_eos=True, cache_salt="slow-grpc"), timeout=180)  # fmt: skip
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        slow_http = http.stream("POST", f"{base_url}/completions", json=body)
        response = slow_http.__enter__()  # (headers come with the first token; nothing is read after them)
        assert response.status_code == 200
        # meanwhile other streams run to the end, exactly
        pairs = short_requests(hf_references, 16)
        started = time.monotonic()
        outs = generate_all(cluster.gateway_address, [r for r, _ in pairs])
        assert [o.token_ids for o in outs] == [e for _, e in pairs]
        print(f"\nslow clients: {len(pairs)} other requests done in {time.monotonic() - started:.1f}s")
        time.sleep(max(0.0, UNREAD_S - (time.monotonic() - t0)))  # the slow clients read nothing meanwhile
        decodes = {n: load(a) for n, a in cluster.addresses.items() if n.startswith("decode")}
        print(f"slow clients after {UNREAD_S} s unread: decode loads",
              {n: (l.num_running, l.num_blocks - l.num_free_blocks) for n, l in decodes.items()})
        # the HTTP client now reads it all: every token is there
        text, usage = "", None
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text += choice.get("text", "")
        slow_http.__exit__(None, None, None)
        assert usage is not None and usage["completion_tokens"] == 400, usage
        # the gRPC client reads a few messages, then cancels
        got = Completion()
        for _ in range(5):
            got.add(next(slow_grpc))
        slow_grpc.cancel()
        assert len(got.token_ids) >= 5
    finally:
        http.close()
        channel.close()
    loads = wait_idle(cluster, timeout_s=30)
    sampling.set()
    sampler.join(timeout=5)
    samples.append((time.monotonic() - t0, rss_mb(pid)))
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), (name, l)
    start, peak, end = samples[0][1], max(r for _, r in samples), samples[-1][1]
    print(f"slow clients: gateway RSS start {start:.0f} MB, max {peak:.0f} MB, end {end:.0f} MB "
          f"({len(samples)} samples over {samples[-1][0]:.0f} s)")
    assert peak - start < 150, f"the gateway grew by {peak - start:.0f} MB"


# -- e. requests cancelled or timed out at random points (200 in the long pass, 16 in make test) ---------------
@pytest.mark.fuzz
def test_random_cancellations_and_deadlines_leave_nothing_behind(cluster, tokenizer, hf_references, hf_greedy):
    num_requests = 200 if LONG else 16
    rng = random.Random(16)
    base_url = cluster.openai_base_url
    model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]
    long_ids = tokenizer(LONG_PROMPT, add_special_tokens=False).input_ids
    long_reference = hf_greedy(long_ids, 48)
    traceback_counts = tracebacks(cluster)
    specs = []
    for i in range(num_requests):
        api = "http" if rng.random() < 0.2 else "grpc"
        is_long = rng.random() < 0.12
        name, kind, text = ("long", "raw", LONG_PROMPT) if is_long else rng.choice(SHORT)
        action = rng.choices(["complete", "cancel", "deadline_ms", "timeout"], [3, 3, 2, 2])[0]
        if api == "http" and action == "deadline_ms":
            action = "timeout"
        delay = rng.uniform(0.0, 3.0 if is_long else 1.5)
        specs.append(dict(i=i, api=api, name=name, kind=kind, text=text, action=action, delay=delay,
                          max_tokens=rng.randint(1, 48), salt=f"e{rng.randrange(1 << 30)}" if is_long else None))

    def expected(spec) -> list[int]:
        ref = long_reference if spec["name"] == "long" else hf_references[spec["name"]][1]
        return ref[: spec["max_tokens"]]

    def run_grpc(spec, channel) -> str:
        request = make_request(spec["text"], raw=spec["kind"] == "raw", max_tokens=spec["max_tokens"],
                               temperature=0.0, cache_salt=spec["salt"])  # fmt: skip
        timeout = 120.0
        if spec["action"] == "deadline_ms":
            request.deadline_ms = max(1, int(spec["delay"] * 1000))
        elif spec["action"] == "timeout":
            timeout = spec["delay"]
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout)
        timer = threading.Timer(spec["delay"], call.cancel)
        if spec["action"] == "cancel":
            timer.start()
        out = Completion()
        try:
            for msg in call:
                out.add(msg)
        except grpc.RpcError as e:
            return f"{e.code().name} {e.details()}"
        finally:
            timer.cancel()
        return "OK" if out.token_ids == expected(spec) and out.finish_reason else f"WRONG {out.token_ids}"

    def run_http(spec) -> str:
        body = {"model": model, "max_tokens": spec["max_tokens"], "temperature": 0, "stream": True}
        if spec["salt"]:
            body["cache_salt"] = spec["salt"]
        if spec["kind"] == "raw":
            url, body["prompt"] = f"{base_url}/completions", spec["text"]
        else:
            url, body["messages"] = f"{base_url}/chat/completions", [{"role": "user", "content": spec["text"]}]
        limit = spec["delay"] if spec["action"] != "complete" else 120.0
        started = time.monotonic()
        try:
            with httpx.Client(timeout=httpx.Timeout(120, read=limit)) as client:
                with client.stream("POST", url, json=body) as response:
                    if response.status_code != 200:
                        return f"HTTP {response.status_code}"
                    for line in response.iter_lines():
                        if spec["action"] != "complete" and time.monotonic() - started > limit:
                            return "CANCELLED"  # (closing the response disconnects: the request is aborted)
                        if line == "data: [DONE]":
                            return "OK"
                        if '"error"' in line:
                            return f"SSE error {line[:200]}"
                    return "ended without [DONE]"
        except httpx.TimeoutException:
            return "CANCELLED"

    def run(spec) -> tuple[dict, str, float]:
        t = time.monotonic()
        if spec["api"] == "http":
            outcome = run_http(spec)
        else:
            with grpc.insecure_channel(cluster.gateway_address) as channel:
                outcome = run_grpc(spec, channel)
        return spec, outcome, time.monotonic() - t

    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(run, s) for s in specs]
        results = [f.result(timeout=600) for f in futures]
    elapsed = time.monotonic() - started
    table: dict[tuple[str, str], dict[str, int]] = {}
    for spec, outcome, _ in results:
        key = (spec["api"], spec["action"])
        table.setdefault(key, {})
        table[key][outcome.split(" ")[0]] = table[key].get(outcome.split(" ")[0], 0) + 1
    print(f"\nrandom faults: {num_requests} requests in {elapsed:.0f} s; outcomes by (api, action): {table}")
    loads = wait_idle(cluster, timeout_s=60)
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), (name, l)
    unexpected = [(s["i"], s["api"], s["action"], s["name"], o) for s, o, _ in results
                  if not (o == "OK" or (s["action"] != "complete" and o.split(" ")[0] in ("CANCELLED",
                                                                                          "DEADLINE_EXCEEDED")))]
    assert not unexpected, unexpected
    assert tracebacks(cluster) == traceback_counts, "new tracebacks in the service logs"
    pairs = short_requests(hf_references, 16)
    outs = generate_all(cluster.gateway_address, [r for r, _ in pairs])
    assert [o.token_ids for o in outs] == [e for _, e in pairs]


# -- a frozen decode mid-stream -------------------------------------------------------------------------------------
@pytest.mark.heavy  # (about 45 s, most of it the keepalive's 15 s and the streams' rerun; make test migrates the
# streams of a decode process killed mid-stream in test_tensor_parallel.py and of a failed decode in test_migration.py)
def test_a_frozen_decode_migrates_its_streams_and_recovers(cluster):
    """A decode stopped by SIGSTOP keeps its connections open (the kernel answers for it), so only the gateway's
    keepalive pings (services/channels.py) can tell: its streams, which set no deadline, migrate to the other
    decode within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS (and some scheduling) and end as if nothing happened;
    once it runs again it frees their blocks."""
    import signal

    from tandem.services.channels import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

    results: dict[int, str] = {}
    outs = {i: Completion() for i in range(2)}
    requests = {i: make_request(f"Count slowly from {i}.", max_tokens=400, temperature=0.0, ignore_eos=True,
                                cache_salt=f"frozen-{i}") for i in range(2)}  # fmt: skip

    def read(i: int) -> None:
        try:
            for msg in generate_stream(cluster.gateway_address, requests[i]):
                outs[i].add(msg)
            results[i] = "OK"
        except grpc.RpcError as e:
            results[i] = f"{e.code().name}: {e.details()}"

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 120
    decodes = [n for n in cluster.addresses if n.startswith("decode")]
    while not (busy := [n for n in decodes if load(cluster.addresses[n]).num_running]):
        assert time.monotonic() < deadline, "no stream reached a decode"
        time.sleep(0.2)
    victim = busy[0]
    log_offset = len((cluster.log_dir / "gateway.log").read_text())
    cluster.processes[victim].send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        for t in readers:
            t.join(timeout=(KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 60)
    finally:
        cluster.processes[victim].send_signal(signal.SIGCONT)
    ended_s = time.monotonic() - frozen_at
    log = (cluster.log_dir / "gateway.log").read_text()[log_offset:]
    print(f"\nfrozen {victim}: outcomes {results}, all ended {ended_s:.1f} s after the freeze; "
          f"{log.count('migrated in')} migrated")
    assert not any(t.is_alive() for t in readers), "a stream on the frozen decode never ended"
    assert results == {0: "OK", 1: "OK"}, results
    assert "migrated in" in log
    again = generate_all(cluster.gateway_address, list(requests.values()))
    assert [outs[i].token_ids for i in range(2)] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 400 for o in outs.values())
    loads = wait_idle(cluster, timeout_s=60)
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), (name, l)


def generate_stream(address: str, request):
    """The gateway's Generate stream for request, without a deadline (what a frozen peer must not hang forever)."""
    with grpc.insecure_channel(address) as channel:
        yield from gateway_pb2_grpc.GatewayStub(channel).Generate(request)


# -- a. kill -9 of a decode mid-stream ------------------------------------------------------------------------------
def kill_request(i: int, max_tokens: int) -> gateway_pb2.GenerateRequest:
    """Stream i of the decode kill: greedy (even i) or seeded sampling (odd i); long enough that no stream ends
    while they are started one by one (a decode step is 15-20 ms here)."""
    return make_request(f"Write a long story about the number {i}.", max_tokens=max_tokens,
                        temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 1000 + i,
                        ignore_eos=True, cache_salt=f"kill-decode-{i}")  # fmt: skip


@pytest.mark.heavy  # (about 55 s; make test kills a whole decode process mid-stream in test_tensor_parallel.py: its
# TP 2 decode's rank 0 SIGKILLed, every stream migrated token-exact)
def test_kill_9_of_a_decode_mid_stream_migrates_its_streams(cluster):
    """Streams on both decodes; the victim is the one with fewer of them, so that its last registry record (kept
    until its TTL) makes it the router's first choice: only a gateway that stops routing there at once avoids it.
    Its streams migrate (services/gateway/pipeline.py): no stream fails, and each migrated one, greedy or seeded,
    equals the same request run again without a fault, token for token."""
    max_tokens = 400
    channel = grpc.insecure_channel(cluster.gateway_address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    results: list[dict] = []
    decodes = [n for n in cluster.addresses if n.startswith("decode")]

    def read(i: int) -> None:
        out = results[i]["out"]
        try:
            for msg in stub.Generate(kill_request(i, max_tokens), timeout=180):
                out.add(msg)
                results[i]["request_id"] = msg.request_id
        except grpc.RpcError as e:
            results[i].update(code=e.code(), details=e.details())
        results[i]["ended"] = time.monotonic()

    readers: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 120
        while True:  # one stream at a time (the registry's loads then spread them) until each decode has 2
            running = {n: load(cluster.addresses[n]).num_running for n in decodes}
            if all(k >= 2 for k in running.values()) or len(readers) == 10:
                if all(len(r["out"].token_ids) >= 2 for r in results):
                    break
            else:
                results.append(dict(out=Completion()))
                readers.append(threading.Thread(target=read, args=(len(readers),), daemon=True))
                readers[-1].start()
            assert time.monotonic() < deadline and all("ended" not in r for r in results), results
            time.sleep(0.5)
        running = {n: load(cluster.addresses[n]).num_running for n in decodes}
        victim = min((n for n, k in running.items() if k >= 2), key=lambda n: running[n])
        survivor = next(n for n in decodes if n != victim)
        victim_id = instance_id(cluster, victim)
        metrics_url = cluster.metrics_urls["gateway"]
        decisions_before = metric_samples(metrics_url, "tandem:router_decisions_total")
        migrations_before = metric_samples(metrics_url, "tandem:request_migrations_total")
        log_offset = len((cluster.log_dir / "gateway.log").read_text())
        generated_before = load(cluster.addresses[survivor]).num_generation_tokens
        sent_before = [len(r["out"].token_ids) for r in results]
        cluster.kill(victim)  # SIGKILL: its registry record stays until its TTL runs out
        decisions_after = metric_samples(metrics_url, "tandem:router_decisions_total")
        for t in readers:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in readers)
    finally:
        channel.close()
    del cluster.processes[victim], cluster.addresses[victim]
    log = (cluster.log_dir / "gateway.log").read_text()[log_offset:]
    migrated = [i for i, r in enumerate(results) if f"request {r.get('request_id')}: decode {victim_id}" in log]
    resumed_s = [float(m) / 1000 for m in re.findall(r"migrated in (\d+) ms", log)]
    print(f"\nkill -9 {victim} ({running}): streams migrated {migrated} at tokens "
          f"{[sent_before[i] for i in migrated]}; failed: {[r for r in results if 'code' in r]}; "
          f"next token after the kill: {stats(resumed_s)}")
    assert not [r for r in results if "code" in r], "a stream failed"
    assert len(migrated) == running[victim], (migrated, running)
    migrations = {dict(k)["reason"]: v - migrations_before.get(k, 0)
                  for k, v in metric_samples(metrics_url, "tandem:request_migrations_total").items()}  # fmt: skip
    assert migrations == {"decode_failed": running[victim]}, migrations
    for r in results:
        assert len(r["out"].token_ids) == max_tokens == r["out"].completion_tokens, r
        assert r["out"].finish_reason == "length", r
    assert load(cluster.addresses[survivor]).num_generation_tokens > generated_before
    # the migrated streams equal the same requests run without a fault (greedy, and seeded: a draw depends on
    # (seed, position) only)
    again = generate_all(cluster.gateway_address, [kill_request(i, max_tokens) for i in migrated])
    for i, out in zip(migrated, again):
        assert results[i]["out"].token_ids == out.token_ids, i
        assert results[i]["out"].text == out.text, i
    # ... and nothing new was routed to the dead decode: the gateway stopped routing there at its first broken
    # stream (not only after a reservation failed there)
    to_victim = {dict(k)["reason"]: v - decisions_before.get(k, 0) for k, v in decisions_after.items()
                 if ("instance_id", victim_id) in k and v != decisions_before.get(k, 0)}  # fmt: skip
    failed_there = log.count(f"decode {victim_id} failed while reserving")
    print(f"kill -9 {victim}: placements routed to it after the kill: {to_victim or 0}; placements that failed "
          f"there and were placed again: {failed_there}")
    assert not to_victim and not failed_there, f"routed to the dead decode {victim_id}: {to_victim}"
    loads = wait_idle(cluster, timeout_s=30)
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), (name, l)


# -- b. kill -9 of a prefill mid-transfer, then of the last one ------------------------------------------------------
def _kill_the_prefill_mid_transfer(cluster, salt: str) -> tuple[dict, str, int, float]:
    """Send LONG_PROMPT (greedy, 16 tokens) and kill -9 the prefill that has sent some of its KV blocks and is still
    computing it; wait for the answer. Returns (the client's result: out, ended, first_token_at, or code and details),
    the prefill killed, the blocks it had sent, when it was killed."""
    prefills = [n for n in cluster.addresses if n.startswith("prefill")]
    exported = {n: load(cluster.addresses[n]).num_blocks_exported for n in prefills}
    result: dict = {}

    def run() -> None:
        request = make_request(LONG_PROMPT, raw=True, max_tokens=16, temperature=0.0, cache_salt=salt)
        out = Completion()
        try:
            with grpc.insecure_channel(cluster.gateway_address) as channel:
                for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=180):
                    result.setdefault("first_token_at", time.monotonic())
                    out.add(msg)
        except grpc.RpcError as e:
            result.update(code=e.code(), details=e.details())
        result.update(out=out, ended=time.monotonic())

    client = threading.Thread(target=run, daemon=True)
    client.start()
    deadline, victim = time.monotonic() + 120, None
    while victim is None:  # the prefill that has sent some of the prompt's KV blocks and is still computing
        assert time.monotonic() < deadline and client.is_alive(), ("no KV transfer seen", result)
        for n in prefills:
            l = load(cluster.addresses[n])
            if l.num_running and l.num_blocks_exported - exported[n] >= 3:
                victim, sent = n, l.num_blocks_exported - exported[n]
        time.sleep(0.02)
    killed_at = time.monotonic()
    cluster.kill(victim)
    client.join(timeout=180)
    assert not client.is_alive()
    del cluster.processes[victim], cluster.addresses[victim]
    return result, victim, sent, killed_at


def _assert_whole_and_idle(cluster, result: dict, expected: list[int]) -> None:
    assert "code" not in result, result
    assert result["out"].token_ids == expected
    loads = wait_idle(cluster, timeout_s=30)
    for name, l in loads.items():
        assert (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0), (name, l)


def test_kill_9_of_a_prefill_mid_transfer(cluster, tokenizer, hf_greedy):
    ids = tokenizer(LONG_PROMPT, add_special_tokens=False).input_ids
    result, victim, sent, killed_at = _kill_the_prefill_mid_transfer(cluster, "kill-prefill")
    first_before_kill = result.get("first_token_at", float("inf")) < killed_at
    print(f"\nkill -9 {victim} after {sent} of {len(ids) // 16} KV blocks sent: "
          f"{result.get('code', 'OK')} after {result['ended'] - killed_at:.1f} s, first token before the kill: "
          f"{first_before_kill}")
    # before its first token the request is placed again; after it (the decode fails the broken transfer), it
    # migrates: either way the answer is whole and exact
    log = (cluster.log_dir / "gateway.log").read_text()
    assert ("migrated in" if first_before_kill else "placing it again") in log
    _assert_whole_and_idle(cluster, result, hf_greedy(ids, 48)[:16])


def test_kill_9_of_the_last_prefill_mid_prompt_leaves_the_prompt_to_a_decode(cluster, tokenizer, hf_greedy):
    """No prefill left (the test above killed one; this one kills the other mid-prompt, or both when it runs
    alone): the request is placed again on a decode, which computes the prompt itself, and answers it whole."""
    for name in [n for n in cluster.addresses if n.startswith("prefill")][:-1]:
        cluster.kill(name)
        del cluster.processes[name], cluster.addresses[name]
    ids = tokenizer(LONG_PROMPT, add_special_tokens=False).input_ids
    result, victim, sent, killed_at = _kill_the_prefill_mid_transfer(cluster, "kill-last-prefill")
    print(f"\nkill -9 {victim} (the last prefill) after {sent} KV blocks sent: {result.get('code', 'OK')} after "
          f"{result['ended'] - killed_at:.1f} s")
    assert "computes the prompt itself: no live prefill is left" in (cluster.log_dir / "gateway.log").read_text()
    _assert_whole_and_idle(cluster, result, hf_greedy(ids, 48)[:16])


# -- a decode stopped (SIGTERM) while a stream runs past its drain timeout -------------------------------------------
@pytest.mark.heavy
def test_a_stream_outliving_its_decodes_drain_migrates(cluster):
    """The decode drains (--drain-timeout 5 here): it finishes what it can, then cancels the calls left; the
    stream it cancelled migrates and ends whole, equal to the request run without a fault. (Heavy: 5 s of drain
    is up to 500 tokens on a quiet machine, so the stream and its rerun are 1,000 tokens each.)"""
    request = make_request("Tell me everything about the history of Rome.", max_tokens=1000, temperature=0.0,
                           ignore_eos=True, cache_salt="drain-timeout")  # fmt: skip
    out, result = Completion(), {}

    def read() -> None:
        try:
            for msg in generate_stream(cluster.gateway_address, request):
                out.add(msg)
        except grpc.RpcError as e:
            result.update(code=e.code(), details=e.details())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    decodes = [n for n in cluster.addresses if n.startswith("decode")]
    while not (busy := [n for n in decodes if load(cluster.addresses[n]).num_running]) or len(out.token_ids) < 8:
        assert time.monotonic() < deadline and reader.is_alive(), ("the stream never ran", result)
        time.sleep(0.1)
    victim = busy[0]
    log_offset = len((cluster.log_dir / "gateway.log").read_text())
    stopped_at = time.monotonic()
    assert cluster.terminate(victim, timeout_s=60) == 0  # (drains: the 5 s run out, it cancels the stream, exits 0)
    sent_at_stop = len(out.token_ids)
    reader.join(timeout=120)
    del cluster.processes[victim], cluster.addresses[victim]
    log = (cluster.log_dir / "gateway.log").read_text()[log_offset:]
    print(f"\ndrained {victim} at token {sent_at_stop}: {result or 'OK'}, ended "
          f"{time.monotonic() - stopped_at:.1f} s after the SIGTERM; {log.count('migrated in')} migration")
    assert not reader.is_alive() and not result, result
    assert "migrated in" in log and "(decode_failed)" in log
    assert len(out.token_ids) == 1000 and out.finish_reason == "length"
    assert out.token_ids == generate(cluster.gateway_address, request, timeout=300).token_ids


# -- the gateway stopped (SIGTERM) while requests outlive its drain timeout -----------------------------------------
def test_a_draining_gateway_ends_the_requests_left_with_an_error(cluster):
    """The gateway drains (--drain-timeout 5 here): what still runs 1 s before the timeout ends with an error saying
    it is shutting down, not a cut connection, wherever it waits: an HTTP and a gRPC stream between tokens, a gRPC
    beam search (its steps wait on placements), and an HTTP request whose long prompt may still be computing
    (before its first token: an HTTP 503; after: an error event). SSE ends with [DONE]; the gateway exits 0 within
    the timeout. Last: it stops the gateway."""
    base_url, results = cluster.openai_base_url, {}
    model = httpx.get(f"{base_url}/models", timeout=10).json()["data"][0]["id"]

    def read_http(name: str, prompt: str) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        lines = []
        try:
            with httpx.Client(timeout=httpx.Timeout(60)) as client:
                with client.stream("POST", f"{base_url}/completions", json=body) as response:
                    lines.append(f"HTTP {response.status_code}")
                    lines += [line for line in response.iter_lines() if line]
        except httpx.HTTPError as e:
            lines.append(f"{type(e).__name__}: {e}")
        results[name] = lines

    def read_grpc(name: str, request) -> None:
        out = Completion()
        try:
            for msg in generate_stream(cluster.gateway_address, request):
                out.add(msg)
            results[name] = ("OK", len(out.token_ids))
        except grpc.RpcError as e:
            results[name] = (e.code(), e.details(), len(out.token_ids))

    beam = make_request("1, 2, 3, 4, 5, 6,", raw=True, max_tokens=2000)
    beam.sampling_params.beam_width = beam.sampling_params.n = 2
    readers = [threading.Thread(target=read_http, args=("http", "Tell me everything about the sea.")),
               threading.Thread(target=read_grpc, args=("grpc", make_request(
                   "Tell me everything about the moon.", max_tokens=2000, temperature=0.0, ignore_eos=True))),
               threading.Thread(target=read_grpc, args=("beam", beam))]
    for reader in readers:
        reader.daemon = True
        reader.start()
    deadline = time.monotonic() + 120
    while sum(load(a).num_running for n, a in cluster.addresses.items() if n.startswith("decode")) < 2:
        assert time.monotonic() < deadline and all(r.is_alive() for r in readers), ("the streams never ran", results)
        time.sleep(0.1)
    long_prompt = threading.Thread(target=read_http, args=("http_long", "\n\n".join([LONG_PROMPT] * 2)), daemon=True)
    long_prompt.start()
    readers.append(long_prompt)
    time.sleep(1.0)  # (the beam search's steps run meanwhile)
    stopped_at = time.monotonic()
    assert cluster.terminate("gateway", timeout_s=60) == 0
    took_s = time.monotonic() - stopped_at
    for reader in readers:
        reader.join(timeout=30)
    del cluster.processes["gateway"]
    print(f"\ngateway drained in {took_s:.1f} s: gRPC {results.get('grpc')}, beam {results.get('beam')}; HTTP's "
          f"last events {results.get('http', [])[-2:]}; the long prompt's {results.get('http_long', [])[:2]}")
    assert took_s < cluster.drain_timeout_s + 1, took_s
    for name in ("grpc", "beam"):
        code, details, _ = results[name]
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, results[name]
    assert results["grpc"][2] > 0
    for name in ("http", "http_long"):
        events = results[name]
        if events[0] == "HTTP 503":  # (before its first token)
            assert "shutting down" in json.loads(events[1])["error"]["message"], events
            continue
        assert events[0] == "HTTP 200" and events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"], (error, events[:3])
    assert len(results["http"]) > 4, results["http"][:4]
    log = (cluster.log_dir / "gateway.log").read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
