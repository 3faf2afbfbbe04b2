"""Weight bytes, prefill tokens/s and single-stream decode tokens/s of the engine for fp32, int8 and int4
weights, in one process on the CPU (or --device cuda); with --kv-dtypes, the quality and size of a quantized KV
cache instead.

    python -m tandem.benchmarks.quant [--threads 1] [--int8 DIR]   # DIR from `tandem quantize --method rtn --bits 8`
    python -m tandem.benchmarks.quant --kv-dtypes fp8_e4m3,fp8_e5m2,int8 [--threads 2]

Without --int8 an RTN INT8 checkpoint is written to a temp dir first. INT4 is the packaged Q4_1 GGUF, loaded
natively.

KV mode (fp32 weights, the engine's own forward): each KV dtype against fp32 KV, measured like the weight formats
(tools/evaluation.py): KL(fp32 KV || quantized KV) of next-token distributions and top-1 agreement over the positions
of the eval text (--max-positions, windows of --seq-len, each computed through the paged pool, so every position
attends to quantized keys and values); greedy agreement over the task prompts (tools/data/quant_tasks.jsonl, two per
category, --greedy-tokens each: completions identical to fp32 KV's, and the mean share of fp32's tokens before the
first difference); pool capacity (blocks of 16 tokens in 1 GiB); and bytes per transferred prompt (a
--transfer-tokens prompt prefilled by an exporting engine: the sum of its KVBlocksMessage sizes, as
services/kv_wire.py sends them).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import torch

from tandem.shared.config import ModelConfig
from tandem.tools.evaluation import engine_speed
from tandem.tools.prepare_model import prepare_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--int8", default=None, help="INT8 checkpoint dir (default: write an RTN one)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--kv-dtypes", default=None,
                        help="KV mode: comma list of KV dtypes (fp8_e4m3, fp8_e5m2, int8, bfloat16...) against fp32 KV")
    parser.add_argument("--max-positions", type=int, default=2048, help="KV mode: eval-text positions")
    parser.add_argument("--seq-len", type=int, default=512, help="KV mode: eval window length")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="KV mode: tokens per greedy completion")
    parser.add_argument("--transfer-tokens", type=int, default=1000, help="KV mode: the transferred prompt's length")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = prepare_model()
    if args.kv_dtypes:
        from tandem.kernels import cpu_ext

        cpu_ext.set_num_threads(args.threads)
        result = kv_dtype_table(model_dir, [d.strip() for d in args.kv_dtypes.split(",") if d.strip()], args)
        print(json.dumps(result, indent=2))
        print(markdown_table(result["results"]))
        return
    int8 = args.int8
    if int8 is None:
        int8 = tempfile.mkdtemp(prefix="tandem-int8-")
        subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", "--bits", "8",
                        "--out", int8, "--model", str(model_dir)], check=True)  # fmt: skip
    rows = [engine_speed(ModelConfig.from_dir(model_dir, q), args.device, args.prompt_len, args.decode_tokens)
            for q in (None, int8, "gguf")]  # fmt: skip
    base = rows[0]
    for row in rows:
        row["decode_vs_fp32"] = round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
        row["prefill_vs_fp32"] = round(row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2)
    print(json.dumps({"threads": args.threads, "device": args.device, "results": rows}, indent=2))


@torch.no_grad()
def kv_dtype_table(model_dir, kv_dtypes: list[str], args) -> dict:
    """The KV mode's measurements for fp32 KV and each of kv_dtypes (module docstring); fp32 weights."""
    from transformers import AutoTokenizer

    from tandem.shared.config import CacheConfig
    from tandem.shared.model import load_model
    from tandem.shared.model_runner import ModelRunner
    from tandem.tools.evaluation import EVAL_TEXT, eval_windows, text_token_ids
    from tandem.tools.tasks import load_tasks, prompt_token_ids

    config = ModelConfig.from_dir(model_dir)  # the float checkpoint: fp32 weights, no quantization
    device = torch.device(args.device)
    model = load_model(config, device)
    token_ids = text_token_ids(model_dir, EVAL_TEXT)
    windows = eval_windows(token_ids, args.seq_len, args.max_positions)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [prompt_token_ids(tokenizer, t) for t in load_tasks(limit_per_category=2)]
    transfer_prompt = token_ids[: args.transfer_tokens].tolist()
    rows, reference, reference_greedy = [], None, None
    for kv_dtype in ("float32", *kv_dtypes):
        blocks_per_window = -(-args.seq_len // 16)
        runner = ModelRunner(config, CacheConfig(16, blocks_per_window, kv_dtype), args.device, model=model)
        logprobs = [_window_logprobs(runner, window) for window in windows]
        if reference is None:
            reference = logprobs
        kl = sum(float((ref.exp() * (ref - lp)).sum()) for ref, lp in zip(reference, logprobs)) / windows.numel()
        top1 = sum(int((ref.argmax(-1) == lp.argmax(-1)).sum()) for ref, lp in zip(reference, logprobs))
        greedy = _greedy(config, model, kv_dtype, prompts, args.greedy_tokens, args.device)
        if reference_greedy is None:
            reference_greedy = greedy
        prefix = [_common_prefix(a, b) / max(1, len(a)) for a, b in zip(reference_greedy, greedy)]
        block_bytes = CacheConfig(16, 1, kv_dtype).block_bytes(config)
        rows.append({
            "kv_dtype": kv_dtype, "kl": kl, "top1": top1 / windows.numel(), "num_positions": windows.numel(),
            "greedy_same": sum(a == b for a, b in zip(reference_greedy, greedy)) / len(prompts),
            "greedy_prefix": sum(prefix) / len(prefix), "num_prompts": len(prompts),
            "block_bytes": block_bytes, "blocks_per_gib": 2**30 // block_bytes,
            "transfer_bytes": _transfer_bytes(config, model, kv_dtype, transfer_prompt, args.device),
        })
    for row in rows:
        row["capacity_vs_fp32"] = round(row["blocks_per_gib"] / rows[0]["blocks_per_gib"], 3)
        row["transfer_vs_fp32"] = round(row["transfer_bytes"] / rows[0]["transfer_bytes"], 4)
    return {"model": config.model_id, "device": args.device, "threads": args.threads,
            "transfer_tokens": len(transfer_prompt), "results": rows}


def _window_logprobs(runner, window: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [seq_len, vocab] fp32 of one window computed in one step through runner's paged pool."""
    from tandem.shared.model_runner import run_model

    ids = window.tolist()
    table = list(range(-(-len(ids) // runner.cache_config.block_size)))
    logits = run_model(runner.model, runner.kv_caches, [(ids, 0, table, len(ids))], runner.cache_config.block_size,
                       runner.device, kv_quant=runner.cache_config.kv_quant)
    return torch.log_softmax(logits.float(), dim=-1)


def _greedy(config, model, kv_dtype: str, prompts: list[list[int]], max_tokens: int, device: str) -> list[list[int]]:
    """Greedy completions of prompts (batched in one engine of this KV dtype)."""
    from tandem.shared.config import CacheConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine
    from tandem.shared.request import Request, SamplingParams

    engine = LLMEngine(config, CacheConfig(16, 512, kv_dtype, enable_prefix_caching=False),
                       SchedulerConfig(1024, len(prompts)), device, model=model)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    outs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _transfer_bytes(config, model, kv_dtype: str, prompt: list[int], device: str) -> int:
    """Bytes on the wire for prompt's KV: an exporting (prefill) engine's blocks as KVBlocksMessages."""
    from tandem.services.kv_wire import kv_to_messages
    from tandem.shared.config import CacheConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine
    from tandem.shared.request import Request, SamplingParams

    engine = LLMEngine(config, CacheConfig(16, -(-len(prompt) // 16) + 4, kv_dtype), SchedulerConfig(512, 1), device,
                       export_kv=True, model=model)
    engine.add_request(Request("t", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    total = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.kv is not None:
                total += sum(m.ByteSize() for m in kv_to_messages("t", o.kv, config, kv_dtype=kv_dtype))
    return total


def markdown_table(rows: list[dict]) -> str:
    lines = ["| KV dtype | KL vs fp32 KV (nats) | top-1 | greedy same / prefix | blocks per GiB (x fp32) | "
             "bytes per 1,000-token prompt (x fp32) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['kv_dtype']} | {r['kl']:.5f} | {r['top1']:.4f} | {r['greedy_same']:.2f} / "
                     f"{r['greedy_prefix']:.2f} | {r['blocks_per_gib']:,} ({r['capacity_vs_fp32']:.2f}x) | "
                     f"{r['transfer_bytes']:,} ({r['transfer_vs_fp32']:.4f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
