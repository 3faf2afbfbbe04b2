"""Speculative decoding benchmark: decode tokens/s of one engine (the decode tier's) with and without speculation,
at several batch sizes, greedy, each answer to its end (EOS) or --max-tokens, on three tasks: copy (a code edit:
rewrite a piece of code given in the prompt with one change), chat (free answers) and agent (answers that repeat
across requests: the batch's tool-call requests, from a pool of a few, run in two waves, one after the other, as
an agent loop issues its calls again; the second wave's answers repeat the first's).

    python -m tandem.benchmarks.spec_decode --concurrency 1,8,32 --json spec.json
    python -m tandem.benchmarks.spec_decode --methods plain,ngram,suffix --tasks copy,chat,agent

For each task and batch size, the same requests run once per method (--methods), all in flight at once: plain
(the baseline), ngram (the default: each request gets the drafts that pay), ngram-k (always up to
--num-speculative-tokens drafts), suffix (suffix decoding, adaptive like ngram), draft (a draft model,
--draft-model: by default an INT8 RTN copy of the model, made once under ~/.cache/tandem/drafts) and early-exit
(the model's first --draft-num-layers layers). Suffix decoding's cache of outputs and the speculation gate's
measurements start empty in each run, so a run gains only from the repetition inside its own workload. Decode
tokens/s counts the tokens after each request's first, over the time from the step where every request (of a wave)
has its first token to the end (the median over --repeats alternating runs). Reported per method: that rate and
its ratio to plain (and to ngram), the acceptance rate (accepted / proposed drafts), the mean acceptance length
(tokens a request gains per verified step), and whether every request's tokens equal plain decoding's.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from tandem.kernels import cpu_ext
from tandem.shared.config import SpeculativeConfig
from tandem.shared.engine_args import EngineArgs
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tandem.shared.spec_decode.drafter import SpeculationGate
from tandem.shared.spec_decode.suffix_proposer import SuffixProposer
from tandem.shared.utils import usable_cpus

FUNCTIONS = ["area", "volume", "scale", "clamp", "mean", "norm", "lerp", "count"]
ARGS = ["width", "height", "depth", "factor", "value", "items", "start", "limit"]
TOPICS = ["the sea", "a lost key", "autumn in a small town", "learning to cook", "a robot that paints",
          "the first day at school", "a storm at night", "an old library", "a friendly dragon", "city traffic",
          "a garden in spring", "a long train journey"]  # fmt: skip
CHAT_ASKS = ["Write a short story about {}.", "Describe {} in a few sentences.", "Write a poem about {}."]
TOOLS = [("get_weather", "city", "Paris"), ("search_web", "query", "cheap flights to Rome"),
         ("read_file", "path", "src/main.py"), ("send_email", "to", "alice@example.com")]  # fmt: skip


def copy_prompt(i: int) -> str:
    """A ~15-line Python module and the request to rename one identifier in it (a different one per i)."""
    f, g = FUNCTIONS[i % len(FUNCTIONS)], FUNCTIONS[(i + 3) % len(FUNCTIONS)]
    a, b = ARGS[i % len(ARGS)], ARGS[(i + 5) % len(ARGS)]
    code = (f"def {f}({a}, {b}):\n    \"\"\"Return the {f} of {a} and {b}.\"\"\"\n    if {a} < 0 or {b} < 0:\n"
            f"        raise ValueError(\"{a} and {b} must be non-negative\")\n    return {a} * {b}\n\n\n"
            f"def {g}({a}, {b}, offset=0):\n    total = {f}({a}, {b}) + offset\n    return total / 2\n\n\n"
            f"def report({a}, {b}):\n    print(\"{f}:\", {f}({a}, {b}))\n    print(\"{g}:\", {g}({a}, {b}))\n")
    return f"Rewrite this code with `{a}` renamed to `{a}_value`. Reply with the code only.\n\n```python\n{code}```"


def chat_prompt(i: int) -> str:
    return CHAT_ASKS[i % len(CHAT_ASKS)].format(TOPICS[i % len(TOPICS)])


def agent_prompt(i: int) -> str:
    """A tool call in an agent's loop, from a pool of len(TOOLS): requests i and i + len(TOOLS) are the same."""
    tool, arg, value = TOOLS[i % len(TOOLS)]
    return (f"You are an agent with the tools get_weather(city), search_web(query), read_file(path) and "
            f"send_email(to). Call {tool} with {arg} = {value!r}. Reply with the call as one JSON object "
            f"{{\"tool\": ..., \"arguments\": {{...}}}}, then explain in one sentence why you call it.")


TASKS = {"copy": copy_prompt, "chat": chat_prompt, "agent": agent_prompt}
WAVES = {"agent": 2}  # the batch's requests run this many times, one wave after the other (default 1)


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, waves: int = 1
              ) -> tuple[list[list[int]], float, dict]:
    """All prompts at once, greedy, to the end, waves times over: (tokens per request and wave, decode seconds,
    spec stats delta). Suffix decoding's cache of outputs and the speculation gate's measurements start empty, so
    a run does not inherit what an earlier task taught the engine (measured: chat at batch 8 at 0.91x plain after
    copy, 0.97x alone; agent at 32 with suffix 0.82x after chat, 1.15x alone)."""
    before = engine.stats()
    drafter = engine.drafter
    if drafter is not None:
        drafter.gate = SpeculationGate()
        if isinstance(drafter.proposer, SuffixProposer):
            c = drafter.config
            drafter.proposer = SuffixProposer(c.suffix_max_spec_factor, c.suffix_min_token_prob,
                                              c.suffix_cache_tokens)
    tokens, seconds = [], 0.0
    for wave in range(waves):
        requests = [Request(f"w{wave}-r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
                    for i, ids in enumerate(prompts)]  # fmt: skip
        for r in requests:
            engine.add_request(r)
        outputs = {r.request_id: [] for r in requests}
        decode_start = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
            if decode_start is None and all(outputs.values()):
                decode_start = time.perf_counter()
        seconds += time.perf_counter() - decode_start
        tokens += [outputs[r.request_id] for r in requests]
    after = engine.stats()
    spec = {k: getattr(after, k) - getattr(before, k)
            for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}  # fmt: skip
    return tokens, seconds, spec


def draft_prompt_cost(engine: LLMEngine, num_tokens: int = 1000) -> str:
    """What the draft model's prompt KV costs on the decode: its forward over a num_tokens prompt (the catch-up
    of a request's first speculative step) beside the target's prefill of it, and the bytes that KV would add
    to a transfer instead."""
    from tandem.shared.model_runner import run_model

    runner, draft = engine.model_runner, engine.drafter.draft_model
    block_size = runner.cache_config.block_size
    table = list(range(-(-num_tokens // block_size)))
    ids = torch.randint(100, runner.model_config.vocab_size, (num_tokens,)).tolist()
    seconds = {}
    for name, model, kv in (("target", runner.model, runner.kv_caches), ("draft", draft.model, draft.kv_caches)):
        start = time.perf_counter()
        run_model(model, kv, [(ids, 0, table, 1)], block_size, runner.device)
        seconds[name] = time.perf_counter() - start
    per_token = draft.kv_caches[:, :, 0, 0].numel() * draft.kv_caches.element_size()
    return (f"draft prompt KV: a {num_tokens}-token prompt takes the draft {seconds['draft']:.2f} s on the decode "
            f"(the target's prefill of it: {seconds['target']:.2f} s); shipping it instead would add "
            f"{per_token * num_tokens / 1e6:.1f} MB to the transfer")


def int8_copy(model_dir: str) -> str:
    """An INT8 RTN copy of the model (the default draft), made once."""
    from pathlib import Path

    from tandem.tools.quantize import main as quantize

    out = Path.home() / ".cache" / "tandem" / "drafts" / f"{Path(model_dir).name}-int8-rtn"
    if not (out / "config.json").exists():
        quantize(["--method", "rtn", "--bits", "8", "--model", model_dir, "--out", str(out)])
    return str(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.benchmarks.spec_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--concurrency", default="1,8,32", help="batch sizes, comma-separated (default 1,8,32)")
    p.add_argument("--tasks", default="copy,chat,agent", help=f"of {', '.join(TASKS)} (default all)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step at most (default: the method's, 4; suffix 15)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch's threads (an engine's: 1)")
    p.add_argument("--kernel-threads", type=int, default=None,
                   help="the C++ kernels' threads (default: every CPU this process may use, as a decode engine)")
    p.add_argument("--repeats", type=int, default=1, help="runs per method, alternating; the median is reported")
    p.add_argument("--methods", default="plain,ngram,ngram-k,suffix,draft,early-exit",
                   help="of plain, ngram, ngram-k, suffix, draft, early-exit (plain is always run: the baseline)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint dir (default: an INT8 RTN copy)")
    p.add_argument("--draft-num-layers", type=int, default=None, help="early-exit depth (default: the engine's)")
    p.add_argument("--json", default=None, metavar="FILE")
    return p.parse_args(argv)


def speculative_configs(args: argparse.Namespace, model_dir: str) -> dict[str, SpeculativeConfig | None]:
    """method name -> its SpeculativeConfig (plain: None), plain first."""
    k = args.num_speculative_tokens
    names = ["plain"] + [m for m in args.methods.split(",") if m != "plain"]
    draft_model = args.draft_model or (int8_copy(model_dir) if "draft" in names else None)
    configs = {"plain": lambda: None, "ngram": lambda: SpeculativeConfig("ngram", k),  # the default: adaptive
               "ngram-k": lambda: SpeculativeConfig("ngram", k, adaptive=False),  # always up to k drafts
               "suffix": lambda: SpeculativeConfig("suffix", k),  # adaptive, like ngram
               "draft": lambda: SpeculativeConfig("draft", k, draft_model=draft_model),
               "early-exit": lambda: SpeculativeConfig("early-exit", k, draft_num_layers=args.draft_num_layers)}
    return {name: configs[name]() for name in names}


def result_row(task: str, batch: int, name: str, rates: dict[str, list[float]], results: dict) -> dict:
    """One method's row of a (task, batch) cell: its median rate, the ratios, acceptance, identity to plain."""
    tokens, s = results[name]
    rate, plain_rate = float(np.median(rates[name])), float(np.median(rates["plain"]))
    ngram_rate = float(np.median(rates["ngram"])) if "ngram" in rates else None
    return {"task": task, "batch": batch, "method": name, "decode_tokens_per_s": rate, "all_rates": rates[name],
            "vs_plain": rate / plain_rate, "vs_ngram": rate / ngram_rate if ngram_rate else None,
            "num_output_tokens": sum(map(len, tokens)), "identical_to_plain": tokens == results["plain"][0], **s,
            "acceptance_rate": s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
            if s["spec_num_draft_tokens"] else None,
            "mean_acceptance_length": 1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
            if s["spec_num_drafts"] else None}  # fmt: skip


def print_row(row: dict) -> None:
    accept = "-" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f}%"
    length = "-" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}"
    vs_ngram = "-" if row["vs_ngram"] is None else f"{row['vs_ngram']:.2f}x"
    print(f"{row['task']:<6}{row['batch']:>6}  {row['method']:<11}{row['decode_tokens_per_s']:>13.1f}"
          f"{row['vs_plain']:>8.2f}x{vs_ngram:>9}{accept:>8}{length:>9}{row['num_output_tokens']:>8}  "
          f"{'yes' if row['identical_to_plain'] else 'NO'}", flush=True)  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from tandem.tools.prepare_model import prepare_model

    torch.set_num_threads(args.threads)
    cpu_ext.set_num_threads(args.kernel_threads or usable_cpus())
    model_dir = str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config, cache_config, scheduler_config = EngineArgs(num_blocks=1536).create_configs("decode", model_dir)
    methods = speculative_configs(args, model_dir)
    engines = {}  # one engine (and one copy of the weights) per method, reused
    rows = []
    print(f"{'task':<6}{'batch':>6}  {'method':<11}{'decode tok/s':>13}{'vs plain':>9}{'vs ngram':>9}{'accept':>8}"
          f"{'mean len':>9}{'tokens':>8}  identical")  # fmt: skip
    for task in args.tasks.split(","):
        for batch in [int(c) for c in args.concurrency.split(",")]:
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task](i)}],
                                                     add_generation_prompt=True, return_dict=False)
                       for i in range(batch)]  # fmt: skip
            rates = {name: [] for name in methods}
            results = {}
            for _ in range(args.repeats):  # the methods alternate, so that a slow spell hits each alike
                for name, spec in methods.items():
                    if name not in engines:
                        engines[name] = LLMEngine(model_config, cache_config, scheduler_config,
                                                  speculative_config=spec)  # fmt: skip
                        # NOTE: touch the whole pool first: its pages are mapped lazily, and the first run paid
                        # for that (measured: 1.1 tok/s instead of 16 when memory was short)
                        engines[name].model_runner.kv_caches.fill_(0)
                    tokens, seconds, s = run_batch(engines[name], prompts, args.max_tokens, WAVES.get(task, 1))
                    rates[name].append(sum(len(t) - 1 for t in tokens) / seconds)
                    results[name] = tokens, s
            for name in results:
                rows.append(result_row(task, batch, name, rates, results))
                print_row(rows[-1])
    if "draft" in engines:
        print(draft_prompt_cost(engines["draft"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
