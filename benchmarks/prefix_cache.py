"""Prefix-caching benchmark: a multi-tenant shared-prefix workload and a multi-turn chat, each on a fresh
LocalCluster (Redis, gateway, two prefill processes, one decode), every request greedy with ignore_eos.

    python -m tandem.benchmarks.prefix_cache --json prefix.json

- tenants: --tenants tenants, each with its own --prefix-len-token system prompt and --questions short distinct
  questions (12-40 tokens), interleaved in a seeded order, --concurrency in flight. One prefill's pool
  (--prefill-blocks) holds fewer than all the tenants' prefixes. The same requests run three times: cache-aware
  and round-robin routing with --local-prefill-tokens 0 (every prompt goes to a prefill, so what differs is the
  prefill routing), then the defaults (cache-aware, and the decode computes a short uncached part itself).
  Hit rate = cached prompt tokens / prompt tokens. The ideal hit rate counts, for each request, the whole blocks
  it shares with an earlier request (at most all but its last token): what an unbounded cache with perfect
  routing would serve.
- cold vs warm, on the defaults cluster after its tenants: --questions requests one at a time, each with a system
  prompt nobody has sent (cold); then one new tenant's prompt once, and --questions of its questions (warm).
- chat: --conversations conversations of --turns turns at once; each turn's prompt is the previous prompt, its
  answer and a new question. With decode-side reuse (the defaults) and without (the decode started with
  --no-enable-prefix-caching). Reported: KV blocks shipped to the decode, prompt tokens the prefill tier computed,
  TTFT of turns 2 and later.
- tiers: --tier-tenants tenants whose system prompts together exceed the prefill tier's pools (two prefills of
  --tier-prefill-blocks each) about 10x, --tier-questions questions each, shuffled, --concurrency in flight, every
  prompt sent to a prefill (--local-prefill-tokens 0). The same requests with the KV tiers below the pool off and
  on (--tier-host-gib of host memory per prefill, then a disk tier in a temporary directory): hit rate against
  the ideal, throughput, TTFT by the tier that served most of each request's hit (Usage.cached_tokens_host/disk).
  Then, one at a time on each cluster: one new question per tenant (tenants in the order they first came, so the
  oldest prefixes have sunk the deepest) and --tier-cold prompts with a system prompt nobody has sent (computed
  in full). Last, the tiers-on cluster is stopped and started again on the same disk directory (new processes,
  new instance ids) and asked one new question per tenant: what a restart keeps.

Over 400 lines on purpose: its two workloads share the cluster set-up, the hit-rate accounting and the report.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import tempfile

import numpy as np

import grpc
from tqdm import tqdm

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.backends.cluster import ClusterBackend
from tandem.benchmarks.bench.metrics import BenchmarkMetrics, compute_metrics
from tandem.benchmarks.bench.report import write_json
from tandem.benchmarks.bench.runner import Load, run_streaming
from tandem.benchmarks.bench.workloads import BenchRequest, corpus_token_ids, cut_prompt
from tandem.shared.engine_args import EngineArgs
from tandem.v1 import common_pb2, common_pb2_grpc

QUESTION_LENS = (12, 40)  # tokens, uniform
CHAT_OUTPUT_LEN = 32


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One cluster set-up: its name in the report and the flags that make it."""

    name: str
    gateway_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()


CACHE_AWARE = Scenario("cache-aware", gateway_args=("--local-prefill-tokens", "0"))
ROUND_ROBIN = Scenario("round-robin", gateway_args=("--routing", "round-robin"))
DEFAULTS = Scenario("defaults")  # cache-aware + local prefill of short uncached parts
NO_DECODE_REUSE = Scenario("no decode reuse", decode_args=("--no-enable-prefix-caching",))
TIERS_OFF = Scenario("tiers off", gateway_args=("--local-prefill-tokens", "0"))


def tiers_on(host_gib: float, disk_dir: str) -> Scenario:
    return Scenario("tiers on", gateway_args=TIERS_OFF.gateway_args,
                    prefill_args=("--kv-host-tier-gib", str(host_gib), "--kv-disk-tier-dir", disk_dir))


class Workload:
    """Seeded prompts cut from the shipped text: tenants' system prompts and questions, tokenized as the gateway
    tokenizes a raw prompt."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        self.corpus = corpus_token_ids(tokenizer)
        self.index = 0

    def text(self, length: int) -> str:
        return cut_prompt(self.tokenizer, self.corpus, length, self.rng)[0]

    def question(self) -> str:
        return "\n\nQuestion: " + self.text(self.rng.randint(*QUESTION_LENS))

    def request(self, prompt: str, output_len: int) -> BenchRequest:
        ids = tuple(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        self.index += 1
        return BenchRequest(self.index - 1, prompt, ids, output_len)

    def tenants(self, num_tenants: int, num_questions: int, prefix_len: int, output_len: int) -> list[BenchRequest]:
        self.prefixes = [self.text(prefix_len) for _ in range(num_tenants)]
        order = [t for t in range(num_tenants) for _ in range(num_questions)]
        self.rng.shuffle(order)
        self.order = list(dict.fromkeys(order))  # the tenants in the order they first come
        return [self.request(self.prefixes[t] + self.question(), output_len) for t in order]

    def follow_ups(self, output_len: int) -> list[BenchRequest]:
        """One new question per tenant of the last tenants(), in the order they first came."""
        return [self.request(self.prefixes[t] + self.question(), output_len) for t in self.order]


def ideal_cached_tokens(requests: list[BenchRequest], block_size: int) -> list[int]:
    """Per request: its leading tokens in whole blocks shared with an earlier request, at most all but its last
    token (the tokens an unbounded prefix cache with perfect routing serves)."""
    out = []
    for i, r in enumerate(requests):
        ids, shared = r.prompt_token_ids, 0
        for earlier in requests[:i]:
            n = 0
            for a, b in zip(ids, earlier.prompt_token_ids):
                if a != b:
                    break
                n += 1
            shared = max(shared, n)
        out.append(min(shared, len(ids) - 1) // block_size * block_size)
    return out


async def instance_loads(cluster) -> dict[str, common_pb2.InstanceLoad]:
    """Instance.GetLoad of every engine process of a LocalCluster, by its name (prefill0, decode0, ...)."""
    loads = {}
    for name, address in cluster.addresses.items():
        async with grpc.aio.insecure_channel(address) as channel:
            loads[name] = await common_pb2_grpc.InstanceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
    return loads


def load_delta(before: dict, after: dict, tier: str, field: str) -> int:
    """The growth of a counter over a tier's processes between two instance_loads."""
    return sum(getattr(after[n], field) - getattr(before[n], field) for n in after if n.startswith(tier))


class ClusterSession:
    """A LocalCluster of one scenario, started on entry (two warm-up requests, one per prefill) and stopped on
    exit."""

    def __init__(self, args, model_dir: str, scenario: Scenario, workload: Workload, prefill_blocks: int | None = None):
        engine = ["--threads", str(args.threads)]
        blocks = ["--num-blocks", str(prefill_blocks or args.prefill_blocks)]
        self.backend = ClusterBackend(model_dir, EngineArgs(), log_dir=None, request_timeout_s=args.request_timeout,
                                      num_prefill=2, prefill_args=engine + blocks + list(scenario.prefill_args),
                                      decode_args=engine + list(scenario.decode_args),
                                      gateway_args=list(scenario.gateway_args))  # fmt: skip
        self.warmup = [workload.request(workload.text(40), 4) for _ in range(2)]

    async def __aenter__(self) -> ClusterSession:
        await self.backend.start()
        for request in self.warmup:
            await self.backend.generate(request)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.backend.stop()

    async def run(self, requests: list[BenchRequest], concurrency: int, label: str) -> tuple[list, float]:
        with tqdm(total=len(requests), desc=label, unit="req", file=sys.stderr) as progress:
            run = await run_streaming(self.backend, requests, Load(concurrency=concurrency), 0, progress)
        return run.results, run.duration_s


def summarize(name: str, results: list[RequestResult], duration_s: float, ideal: list[int] | None = None) -> dict:
    """One row of the report: metrics, hit rate and (with ideal) the ideal hit rate."""
    m: BenchmarkMetrics = compute_metrics(results, duration_s)
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_len for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    row = {"scenario": name, **m.as_json(), "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None}
    if ideal is not None:
        ideal_ok = sum(c for c, r in zip(ideal, results) if r.ok)
        row["ideal_hit_rate"] = ideal_ok / prompt if prompt else None
    row["requests"] = [{"index": r.index, "prompt_len": r.prompt_len, "cached_tokens": r.cached_tokens,
                        "ttft_ms": r.ttft_s * 1000 if r.ok else None, "error": r.error} for r in results]  # fmt: skip
    return row


async def tenants_and_cold_warm(args, model_dir: str, workload: Workload) -> dict:
    requests = workload.tenants(args.tenants, args.questions, args.prefix_len, args.output_len)
    ideal = ideal_cached_tokens(requests, EngineArgs().block_size)
    cold = [workload.request(workload.text(args.prefix_len) + workload.question(), args.output_len)
            for _ in range(args.questions)]  # fmt: skip
    prefix = workload.text(args.prefix_len)
    warm = [workload.request(prefix + workload.question(), args.output_len) for _ in range(args.questions + 1)]
    rows, cold_warm = [], {}
    for scenario in (CACHE_AWARE, ROUND_ROBIN, DEFAULTS):
        async with ClusterSession(args, model_dir, scenario, workload) as session:
            results, duration = await session.run(requests, args.concurrency, f"tenants, {scenario.name}")
            row = summarize(scenario.name, results, duration, ideal)
            loads = await instance_loads(session.backend.cluster)
            row["evictions"] = {n: lo.num_evictions for n, lo in loads.items()}
            rows.append(row)
            if scenario is DEFAULTS:
                results, duration = await session.run(cold, 1, "cold, one at a time")
                cold_warm["cold"] = summarize("cold", results, duration)
                await session.run(warm[:1], 1, "warm-up of the warm tenant")
                results, duration = await session.run(warm[1:], 1, "warm, one at a time")
                cold_warm["warm"] = summarize("warm", results, duration)
    return {"tenants": rows, "cold_warm": cold_warm}


async def chat(args, model_dir: str, workload: Workload) -> list[dict]:
    systems = [workload.text(args.chat_prefix_len) for _ in range(args.conversations)]
    questions = [[workload.question() for _ in range(args.turns)] for _ in range(args.conversations)]
    rows = []
    for scenario in (DEFAULTS, NO_DECODE_REUSE):
        async with ClusterSession(args, model_dir, scenario, workload) as session:
            before = await instance_loads(session.backend.cluster)
            results: list[RequestResult] = []

            async def conversation(c: int) -> None:
                prompt = systems[c]
                for turn in range(args.turns):
                    prompt += questions[c][turn] + "\nAnswer:"
                    result = await session.backend.generate(workload.request(prompt, CHAT_OUTPUT_LEN))
                    results.append(dataclasses.replace(result, index=turn))  # index: the turn, for the report
                    prompt += workload.tokenizer.decode(result.output_token_ids, skip_special_tokens=True)

            start = asyncio.get_running_loop().time()
            await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
            duration = asyncio.get_running_loop().time() - start
            after = await instance_loads(session.backend.cluster)
            later = [r for r in results if r.index > 0]
            row = summarize(scenario.name, later, duration)
            row["blocks_shipped"] = load_delta(before, after, "decode", "num_blocks_imported")
            row["prefill_tokens_computed"] = (load_delta(before, after, "prefill", "prefix_cache_queries")
                                              - load_delta(before, after, "prefill", "prefix_cache_hits"))  # fmt: skip
            rows.append(row)
    return rows


def hit_tier(result: RequestResult, block_size: int) -> str:
    """The tier that served most of a request's cached prompt tokens ("pool", "host", "disk"), or "computed" when
    less than a block was cached."""
    by_tier = result.cached_tokens_by_tier or {}
    if sum(by_tier.values()) < block_size:
        return "computed"
    return max(by_tier, key=by_tier.get)


def ttft_by_tier(results: list[RequestResult], block_size: int) -> dict[str, dict]:
    """{tier of the hit: {"requests", "ttft_p50_ms", "ttft_p99_ms"}} over the completed requests."""
    groups: dict[str, list[float]] = {}
    for r in results:
        if r.ok:
            groups.setdefault(hit_tier(r, block_size), []).append(r.ttft_s * 1000)
    return {tier: {"requests": len(ms), "ttft_p50_ms": float(np.median(ms)),
                   "ttft_p99_ms": float(np.percentile(ms, 99))} for tier, ms in sorted(groups.items())}  # fmt: skip


async def tiers(args, model_dir: str, workload: Workload) -> dict:
    block_size = EngineArgs().block_size
    requests = workload.tenants(args.tier_tenants, args.tier_questions, args.prefix_len, args.output_len)
    ideal = ideal_cached_tokens(requests, block_size)
    follow_ups = {name: workload.follow_ups(args.output_len) for name in ("tiers off", "tiers on", "restarted")}
    cold = [workload.request(workload.text(args.prefix_len) + workload.question(), args.output_len)
            for _ in range(args.tier_cold)]  # fmt: skip
    pools = 2 * args.tier_prefill_blocks * block_size
    doc = {"pool_tokens": pools, "prefix_tokens": args.tier_tenants * args.prefix_len, "rows": []}
    with tempfile.TemporaryDirectory(prefix="tandem-kv-tier-") as disk_dir:
        on = tiers_on(args.tier_host_gib, disk_dir)
        for scenario in (TIERS_OFF, on, dataclasses.replace(on, name="restarted")):
            async with ClusterSession(args, model_dir, scenario, workload, args.tier_prefill_blocks) as session:
                row = {"scenario": scenario.name}
                if scenario.name != "restarted":
                    results, duration = await session.run(requests, args.concurrency, f"tiers, {scenario.name}")
                    row |= summarize(scenario.name, results, duration, ideal)
                    row["ttft_by_tier"] = ttft_by_tier(results, block_size)
                results, _ = await session.run(follow_ups[scenario.name], 1, f"follow-ups, {scenario.name}")
                row["follow_ups"] = ttft_by_tier(results, block_size)
                if scenario.name != "restarted":
                    results, _ = await session.run(cold, 1, f"cold prompts, {scenario.name}")
                    row["cold"] = ttft_by_tier(results, block_size)
                loads = await instance_loads(session.backend.cluster)
                row["tier_hits"] = {n: dict(lo.kv_tier_hits) for n, lo in loads.items() if n.startswith("prefill")}
                row["tier_load_ms_per_block"] = {n: {t: s * 1000 for t, s in lo.kv_tier_load_s.items()}
                                                 for n, lo in loads.items() if n.startswith("prefill")}  # fmt: skip
                doc["rows"].append(row)
    return doc


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def print_report(doc: dict) -> None:
    if "tenants" in doc:
        print("\ntenants: cache-aware vs round-robin routing on the same requests (TTFT in ms)")
        print(f"{'scenario':<16}{'ok/fail':>9}{'hit rate':>10}{'ideal':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'out tok/s':>11}  evictions")  # fmt: skip
        for r in doc["tenants"]:
            print(f"{r['scenario']:<16}{r['completed']:>5}/{r['failed']:<3}{_pct(r['hit_rate']):>10}"
                  f"{_pct(r['ideal_hit_rate']):>8}{_ms(r['median_ttft_ms']):>10}{_ms(r['p99_ttft_ms']):>10}"
                  f"{r['output_throughput']:>11.1f}  {r['evictions']}")  # fmt: skip
        by_name = {r["scenario"]: r for r in doc["tenants"]}
        ca, rr = by_name["cache-aware"], by_name["round-robin"]
        if ca["median_ttft_ms"] and rr["median_ttft_ms"]:
            print(f"TTFT p50 round-robin / cache-aware: {rr['median_ttft_ms'] / ca['median_ttft_ms']:.2f}x; "
                  f"hit rate / ideal: cache-aware {ca['hit_rate'] / ca['ideal_hit_rate']:.2f}, "
                  f"round-robin {rr['hit_rate'] / rr['ideal_hit_rate']:.2f}")  # fmt: skip
        cold, warm = doc["cold_warm"]["cold"], doc["cold_warm"]["warm"]
        print(f"\ncold vs warm, one at a time: TTFT p50 {_ms(cold['median_ttft_ms'])} vs {_ms(warm['median_ttft_ms'])}"
              f" ms, p99 {_ms(cold['p99_ttft_ms'])} vs {_ms(warm['p99_ttft_ms'])} ms", end="")  # fmt: skip
        if warm["median_ttft_ms"]:
            print(f"; cold / warm p50 {cold['median_ttft_ms'] / warm['median_ttft_ms']:.1f}x")
    if "chat" in doc:
        print("\nchat: turns 2 and later (TTFT in ms)")
        print(f"{'scenario':<16}{'ok/fail':>9}{'blocks shipped':>16}{'prefill tokens':>16}{'TTFT p50':>10}"
              f"{'TTFT p99':>10}")
        for r in doc["chat"]:
            print(f"{r['scenario']:<16}{r['completed']:>5}/{r['failed']:<3}{r['blocks_shipped']:>16}"
                  f"{r['prefill_tokens_computed']:>16}{_ms(r['median_ttft_ms']):>10}{_ms(r['p99_ttft_ms']):>10}")


def print_tiers(doc: dict) -> None:
    print(f"\ntiers: {doc['prefix_tokens']:,} tokens of system prompts over {doc['pool_tokens']:,} tokens of prefill "
          f"pools ({doc['prefix_tokens'] / doc['pool_tokens']:.1f}x); TTFT in ms, p50 / p99 (requests)")
    print(f"{'scenario':<12}{'ok/fail':>9}{'hit rate':>10}{'ideal':>8}{'/ ideal':>9}{'out tok/s':>11}  "
          "TTFT by tier of the hit")

    def by_tier(groups: dict) -> str:
        return ", ".join(f"{t} {_ms(g['ttft_p50_ms'])} / {_ms(g['ttft_p99_ms'])} ({g['requests']})"
                         for t, g in groups.items())  # fmt: skip

    for r in doc["rows"]:
        if "hit_rate" in r:
            ratio = r["hit_rate"] / r["ideal_hit_rate"] if r["ideal_hit_rate"] else None
            print(f"{r['scenario']:<12}{r['completed']:>5}/{r['failed']:<3}{_pct(r['hit_rate']):>10}"
                  f"{_pct(r['ideal_hit_rate']):>8}{_pct(ratio):>9}{r['output_throughput']:>11.1f}  "
                  f"{by_tier(r['ttft_by_tier'])}")  # fmt: skip
    print("one at a time: a new question per tenant (oldest tenants first), and prompts nobody sent before (cold)")
    for r in doc["rows"]:
        print(f"  {r['scenario']:<12} follow-ups: {by_tier(r['follow_ups'])}"
              + (f"; cold: {by_tier(r['cold'])}" if "cold" in r else ""))
        print(f"  {'':<12} tier hits (blocks) {r['tier_hits']}, measured load ms/block {r['tier_load_ms_per_block']}")
    on = next(r for r in doc["rows"] if r["scenario"] == "tiers on")
    disk, cold = on["follow_ups"].get("disk"), on["cold"].get("computed")
    if disk and cold:
        print(f"disk hit / computed, TTFT p50 one at a time: {disk['ttft_p50_ms'] / cold['ttft_p50_ms']:.2f}")


async def run(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from tandem.tools.prepare_model import prepare_model

    torch.set_num_threads(1)
    model_dir = str(prepare_model())
    workload = Workload(AutoTokenizer.from_pretrained(model_dir), args.seed)
    doc = {"args": vars(args)}
    if "tenants" in args.sections:
        doc |= await tenants_and_cold_warm(args, model_dir, workload)
    if "chat" in args.sections:
        doc["chat"] = await chat(args, model_dir, workload)
    if "tiers" in args.sections:
        doc["tiers"] = await tiers(args, model_dir, workload)
    return doc


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tandem.benchmarks.prefix_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--questions", type=int, default=12, help="questions per tenant (default 12), and of the cold and"
                   " of the warm requests")
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens of each tenant's system prompt")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="tenants' requests in flight")
    p.add_argument("--prefill-blocks", type=int, default=160,
                   help="KV blocks of each prefill (default 160: 2,560 tokens, fewer than the tenants' prefixes)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chat-prefix-len", type=int, default=200, help="tokens of each conversation's system prompt")
    p.add_argument("--tier-tenants", type=int, default=26, help="tiers: tenants (default 26: 10x the prefill pools)")
    p.add_argument("--tier-questions", type=int, default=3, help="tiers: questions per tenant")
    p.add_argument("--tier-prefill-blocks", type=int, default=80, help="tiers: KV blocks of each prefill's pool "
                   "(default 80: 1,280 tokens, one tenant's prompt)")
    p.add_argument("--tier-host-gib", type=float, default=0.25, help="tiers: host tier of each prefill, GiB "
                   "(default 0.25: about 5 of the default model's 1,000-token prefixes in fp32)")
    p.add_argument("--tier-cold", type=int, default=6, help="tiers: cold prompts, one at a time")
    p.add_argument("--sections", default="tenants,chat,tiers", help="which tables to run (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    doc = asyncio.run(run(args))
    print_report(doc)
    if "tiers" in doc:
        print_tiers(doc["tiers"])
    if args.json:
        write_json(doc, args.json)


if __name__ == "__main__":
    main()
