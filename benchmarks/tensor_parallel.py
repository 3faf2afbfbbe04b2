"""The cost of tensor parallelism on this machine (docs/parallelism.md): decode tokens/s of one engine at TP 1 with
2 threads (torch and kernel threads) against TP 2 with 1 thread per rank, on the same cores, greedy, the same
requests. On a 2-core CPU TP cannot win: both ranks read their half of the weights from the same memory, and each
layer adds two all-reduces over loopback; this prints by how much it loses, as a ratio (TP 2 / TP 1).

    python -P -m tandem.benchmarks.tensor_parallel --shapes tiny,llama-3.2-1b --json tp.json

Shapes: "tiny" (a random fp32 Llama written here: 8 layers, hidden 1024, 16 query heads over 8 KV heads, MLP 2816,
vocabulary 32000) and those of benchmarks/model_shapes.py whose heads divide by 2 (llama-3.2-1b, random bf16).
Per shape and batch size: tokens/s over the steps after every request has its first token.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TINY = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


def write_tiny() -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tandem.shared.model_files import cache_dir

    out = cache_dir() / "shapes" / "tp-tiny"
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(out)
    return out


def decode_tok_s(path: Path, tp: int, threads: int, batch_sizes: list[int], prompt_len: int,
                 max_tokens: int) -> dict[int, float]:
    from tandem.kernels import cpu_ext
    from tandem.shared.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from tandem.benchmarks.model_shapes import engine_decode_tok_s
    from tandem.shared.engine import LLMEngine

    torch.set_num_threads(threads)
    cpu_ext.set_num_threads(threads)
    config = ModelConfig.from_dir(path)
    engine = LLMEngine(config, CacheConfig(16, 256, config.dtype), SchedulerConfig(512, 64),
                       parallel_config=ParallelConfig(tp, threads, threads))
    try:
        return engine_decode_tok_s(engine, batch_sizes, prompt_len, max_tokens, 30000)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,llama-3.2-1b")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {}
    for shape in args.shapes.split(","):
        if shape == "tiny":
            path = write_tiny()
        else:
            from tandem.benchmarks.model_shapes import write_checkpoint

            path = write_checkpoint(shape)
        tp1 = decode_tok_s(path, 1, 2, batch_sizes, args.prompt_len, args.max_tokens)
        tp2 = decode_tok_s(path, 2, 1, batch_sizes, args.prompt_len, args.max_tokens)
        results[shape] = {"tp1_2_threads_tok_s": tp1, "tp2_1_thread_each_tok_s": tp2,
                          "ratio_tp2_over_tp1": {b: round(tp2[b] / tp1[b], 2) for b in batch_sizes}}
        for b in batch_sizes:
            print(f"{shape} batch {b}: TP 1 x 2 threads {tp1[b]} tok/s, TP 2 x 1 thread {tp2[b]} tok/s, "
                  f"ratio {tp2[b] / tp1[b]:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
