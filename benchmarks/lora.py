"""Multi-LoRA benchmark (docs/lora.md "Benchmark"): prints numbers, asserts nothing.

    python -m tandem.benchmarks.lora [--requests 32] [--max-tokens 32] [--sections mix,routing]

- mix: one prefill and one decode with --enable-lora --max-loras 16; --requests short greedy requests (ignore_eos,
  --max-tokens each) all in flight at once, first all of the base model, then spread round-robin over N adapters
  (N = 1, 4, 16; rank 8 on every projection, random weights made with PEFT). Output tokens/s of each batch, against
  the base alone.
- routing: two prefills and two decodes, each holding at most --max-cpu-loras 2 adapters in memory, serving
  --routing-adapters (4: more than one instance holds, as many as a tier's two hold together) adapters of rank
  --routing-rank (64: about 78 MB each in fp32, so a read from disk costs what a real adapter's
  does; loaded on every engine, so each engine keeps only the last ones in memory); requests pick adapters in a
  seeded random order, --concurrency in flight, once with adapter-aware routing (the default cost model) and once with
  --routing round-robin. TTFT p50 / p99 of each, and how often the router chose a holder
  (tandem:router_lora_decisions_total).
Adapters are written to a temporary directory with PEFT (no download).
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def make_adapters(model_dir: str, out: Path, count: int, rank: int) -> dict[str, str]:
    """{name: dir} of count PEFT adapters of the model (every projection, rank, random weights, seeded)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    paths = {}
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(base, config)
        model.save_pretrained(out / f"lora{i}")
        base = model.unload()  # (the base model back, unadapted, for the next one)
        paths[f"lora{i}"] = str(out / f"lora{i}")
    return paths


def run_batch(cluster, names: list[str | None], max_tokens: int, concurrency: int):
    """Send one greedy request per entry of names (its adapter; None: the base), concurrency in flight; returns
    (completions, seconds)."""
    from tandem.services.client import generate, make_request

    def one(name):
        request = make_request(PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if name is not None:
            request.lora_name = name
        return generate(cluster.gateway_address, request, timeout=900)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        completions = list(pool.map(one, names))
    return completions, time.perf_counter() - started


def load_adapters(cluster, paths: dict[str, str]) -> None:
    import httpx2 as httpx

    for name, path in paths.items():
        r = httpx.post(cluster.openai_base_url + "/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                       timeout=300)  # fmt: skip
        r.raise_for_status()


def mix(model_dir: str, paths: dict[str, str], args) -> None:
    from tandem.services.launcher import LocalCluster

    engine = ["--threads", "1", "--enable-lora", "--max-loras", "16", "--max-cpu-loras", "16", "--max-lora-rank", "8"]
    with LocalCluster(model_dir, prefill_args=engine, decode_args=engine) as cluster:
        load_adapters(cluster, paths)
        run_batch(cluster, [None] * 4, 4, 4)  # (warm-up)
        print(f"\nmix: {args.requests} requests of {args.max_tokens} tokens, all in flight")
        print("| adapters in the batch | output tok/s | of the base's |\n|---|---|---|")
        base_rate = None
        for n in (0, 1, 4, 16):
            names = [None if n == 0 else f"lora{i % n}" for i in range(args.requests)]
            completions, seconds = run_batch(cluster, names, args.max_tokens, args.requests)
            rate = sum(len(c.token_ids) for c in completions) / seconds
            base_rate = base_rate or rate
            print(f"| {n or 'base only'} | {rate:.1f} | {rate / base_rate:.2f} |", flush=True)


def routing(model_dir: str, paths: dict[str, str], args) -> None:
    from tandem.services.launcher import LocalCluster

    engine = ["--threads", "1", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank",
              str(args.routing_rank)]
    # (a seeded random order: a cycle would line up with round-robin's and give each instance a fixed pair)
    names = [f"lora{i}" for i in random.Random(0).choices(range(len(paths)), k=args.requests)]
    print(f"\nrouting: {len(paths)} adapters of rank {args.routing_rank}, engines holding 2 in memory; {args.requests} "
          f"requests, {args.concurrency} in flight, {args.max_tokens} tokens")
    print("| routing | TTFT p50 ms | TTFT p99 ms | holder chosen |\n|---|---|---|---|")
    for policy in ("cache-aware", "round-robin"):
        with LocalCluster(model_dir, num_prefill=2, num_decode=2, prefill_args=engine, decode_args=engine,
                          gateway_args=["--routing", policy]) as cluster:
            load_adapters(cluster, {n: paths[n] for n in sorted(set(names))})
            run_batch(cluster, [None] * 2, 2, 2)  # (warm-up)
            completions, _ = run_batch(cluster, names, args.max_tokens, args.concurrency)
            ttfts = sorted(c.ttft_ms for c in completions)
            samples = lora_decisions(cluster.metrics_urls["gateway"])
            holder, total = samples.get("holder", 0), sum(samples.values()) or 1
            print(f"| {policy} | {statistics.median(ttfts):.0f} | {ttfts[int(0.99 * (len(ttfts) - 1))]:.0f} | "
                  f"{holder / total:.0%} |", flush=True)


def lora_decisions(url: str) -> dict[str, float]:
    """{reason: count} of the gateway's tandem:router_lora_decisions_total, both tiers together."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == "tandem:router_lora_decisions_total":
                counts[sample.labels["reason"]] = counts.get(sample.labels["reason"], 0) + sample.value
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.benchmarks.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sections", default="mix,routing")
    parser.add_argument("--routing-rank", type=int, default=64, help="rank of the routing section's adapters")
    parser.add_argument("--routing-adapters", type=int, default=4, help="adapters the routing section serves")
    args = parser.parse_args(argv)
    from tandem.tools.prepare_model import prepare_model

    model_dir = str(prepare_model())
    with tempfile.TemporaryDirectory(prefix="tandem-lora-") as tmp:
        sections = args.sections.split(",")
        if "mix" in sections:
            mix(model_dir, make_adapters(model_dir, Path(tmp) / "mix", 16, rank=8), args)
        if "routing" in sections:
            routing(model_dir, make_adapters(model_dir, Path(tmp) / "routing", args.routing_adapters,
                                                 rank=args.routing_rank), args)


if __name__ == "__main__":
    main()
