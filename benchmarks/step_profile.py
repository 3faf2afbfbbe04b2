"""Where a decode step's time goes: one engine on the default model, a running batch of --batch-size requests,
each step split into the linears, attention, the other layer ops (norms, RoPE + KV write, activation, embedding),
the forward's remaining Python, sampling and everything outside the forward (scheduling, block tables, inputs,
outputs), by timing those calls over --steps steps. With --prefill-chunk, where a prefill step's time goes
instead: one prompt of --prompt-len tokens prefilled in chunks of that many tokens, each chunk's step split the
same way with the layer ops itemized (norms with their residual adds, RoPE + KV write, MLP activation).

    python -m tandem.benchmarks.step_profile [--dtype float32] [--batch-sizes 1,32] [--kernel-threads 2]
    python -m tandem.benchmarks.step_profile --prefill-chunk 512 --prompt-len 1024 [--quantization gguf]
        [--attention-baseline]

The kernels run on --kernel-threads (a decode engine's default is every CPU), torch on one thread (as an engine).
Timers wrap module and function calls, so the parts add up to the step's time less their own small overhead. The
breakdown is of the Python layers (use_decoder_stack off); the last two columns time the same engine's steps and
forwards with the layers as one C++ call (shared/decoder_stack.py), in rounds alternating with the breakdown's
(the quickest round of each). Prefill chunks are profiled on the Python layers.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, part: str) -> None:
        """Time every call of owner.name (a function of a module, or a method of a class) as part."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", default=None, help="e.g. gguf (default: the fp32 dir's own weights)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--kernel-threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=None, help="profile prefill steps of this many tokens")
    parser.add_argument("--repeats", type=int, default=3, help="prefill: prompts measured (after one warm-up)")
    parser.add_argument("--attention-baseline", action="store_true",
                        help="prefill: also profile prompts with attention on torch's path, alternating")
    args = parser.parse_args(argv)
    from tandem.kernels import cpu_ext
    from tandem.shared import model as model_module
    from tandem.shared import model_runner as runner_module
    from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine
    from tandem.shared.request import Request, SamplingParams
    from tandem.tools.prepare_model import prepare_model

    torch.set_num_threads(1)
    cpu_ext.set_num_threads(args.kernel_threads)
    config = ModelConfig.from_dir(prepare_model(), args.quantization, args.dtype)
    timers = Timers()
    # the model's parts: each wrapped where it is called from (the module's forward or a module-level name)
    for part, owner, name in (("attention", model_module, "paged_attention"),
                              ("norms", model_module.RMSNorm, "forward"),
                              ("rope + kv", model_module.cpu_layer_ops, "rope_write_kv"),
                              ("rope + kv", model_module, "write_kv_cache"),
                              ("activation", model_module.cpu_layer_ops, "silu_and_mul"),
                              ("activation", model_module, "silu_and_mul_ref"),
                              ("forward", model_module.LlamaForCausalLM, "forward"),
                              ("sampling", runner_module, "sample"),
                              ("sampling", runner_module, "process_logits")):
        timers.wrap(owner, name, part)

    def make_engine(num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int) -> LLMEngine:
        engine = LLMEngine(config, CacheConfig(16, num_blocks, config.dtype, enable_prefix_caching=False),
                           SchedulerConfig(max_num_batched_tokens, max_num_seqs))
        for cls in {type(m) for m in engine.model_runner.model.modules()
                    if hasattr(m, "in_features") and not list(m.children())}:
            if not getattr(cls.forward, "_timed", False):
                timers.wrap(cls, "forward", "linears")
                cls.forward._timed = True
        return engine

    if args.prefill_chunk:
        return profile_prefill(args, make_engine, timers, Request, SamplingParams, config.weight_format)
    profile_decode(args, make_engine, timers, Request, SamplingParams, config.weight_format)


def profile_decode(args, make_engine, timers: Timers, Request, SamplingParams, weight_format: str) -> None:
    """Per batch size: a running batch of that many requests; rounds of args.steps decode steps alternating the
    Python layers (timed per part) with the decoder stack (steps and forwards); prints the quickest round of each."""
    print(f"{weight_format}, {args.kernel_threads} kernel threads; ms per step")
    print(f"{'batch':>5} {'step':>7} {'linears':>8} {'attention':>9} {'layer ops':>9} {'fwd rest':>8} "
          f"{'sampling':>8} {'outside':>8} {'stack: step':>11} {'forward':>8}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        engine = make_engine(64 * batch, 2048, max(batch, 1))
        for i in range(batch):
            engine.add_request(Request(f"r{i}", [(j * 7919 + i) % 40000 + 100 for j in range(args.prompt_len)],
                                       SamplingParams(max_tokens=4 * (args.steps + 1) + 20, temperature=0.0,
                                                      ignore_eos=True)))  # (4 rounds of steps)
        while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        best = {}  # use_decoder_stack -> the quickest round's ms per part, "step" included
        for use_stack in (False, True, False, True):  # (alternating: both share the run's load)
            engine.model_runner.model.use_decoder_stack = use_stack
            engine.step()
            timers.seconds.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms = {k: v / args.steps * 1e3 for k, v in timers.seconds.items()}
            ms["step"] = (time.perf_counter() - start) / args.steps * 1e3
            if use_stack not in best or ms["step"] < best[use_stack]["step"]:
                best[use_stack] = ms
        ms, stack = best[False], best[True]
        layer_ops = ms["norms"] + ms["rope + kv"] + ms["activation"]
        inside = ms["linears"] + ms["attention"] + layer_ops
        print(f"{batch:5} {ms['step']:7.2f} {ms['linears']:8.2f} {ms['attention']:9.2f} {layer_ops:9.2f} "
              f"{ms['forward'] - inside:8.2f} {ms['sampling']:8.2f} {ms['step'] - ms['forward'] - ms['sampling']:8.2f} "
              f"{stack['step']:11.2f} {stack['forward']:8.2f}")


PREFILL_PARTS = ("linears", "attention", "norms", "rope + kv", "activation")


def profile_prefill(args, make_engine, timers: Timers, Request, SamplingParams, weight_format: str) -> None:
    """One prompt of args.prompt_len tokens prefilled in chunks of args.prefill_chunk, args.repeats times after a
    warm-up; prints each chunk's step in ms (the median over the repeats) split into PREFILL_PARTS, the forward's
    remaining Python (embedding, module calls, the LM head's row), and the step outside the forward. With
    args.attention_baseline the same for prompts whose attention takes torch's path (the CPU prefill kernel
    switched off), alternating with the kernel's."""
    from tandem.kernels import cpu_prefill_attention

    prompt = [(j * 7919) % 40000 + 100 for j in range(args.prompt_len)]
    engine = make_engine(args.prompt_len // 16 + 8, args.prefill_chunk, 4)
    engine.model_runner.model.use_decoder_stack = False  # (the breakdown times the Python layers' calls)
    supports = cpu_prefill_attention.supports
    modes = ["kernel", "torch"] if args.attention_baseline else ["kernel"]
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for repeat in range(args.repeats + 1):
        for mode in modes:
            cpu_prefill_attention.supports = supports if mode == "kernel" else (lambda *a, **k: False)
            engine.add_request(Request(f"p{repeat}-{mode}", prompt, SamplingParams(max_tokens=1, temperature=0.0)))
            chunk = 0
            while engine.has_unfinished_requests():
                timers.seconds.clear()
                start = time.perf_counter()
                engine.step()
                ms = {k: v * 1e3 for k, v in timers.seconds.items()}
                ms["step"] = (time.perf_counter() - start) * 1e3
                if repeat > 0:
                    rows.setdefault((mode, chunk), []).append(ms)
                chunk += 1
            cpu_prefill_attention.supports = supports
    print(f"{weight_format}, {args.kernel_threads} kernel threads, chunks of {args.prefill_chunk}; ms per chunk "
          f"(median of {args.repeats}); attention: the CPU prefill kernel or torch's path")
    columns = ("step", *PREFILL_PARTS, "fwd rest", "outside")
    print(f"{'attention':>9} {'chunk':>5} {'prefix':>6} " + " ".join(f"{c:>10}" for c in columns))
    for (mode, chunk), samples in rows.items():
        for ms in samples:
            ms["fwd rest"] = ms["forward"] - sum(ms.get(p, 0.0) for p in PREFILL_PARTS)
            ms["outside"] = ms["step"] - ms["forward"]
        medians = [statistics.median(ms.get(c, 0.0) for ms in samples) for c in columns]
        print(f"{mode:>9} {chunk:5} {chunk * args.prefill_chunk:6} " + " ".join(f"{m:10.2f}" for m in medians))


if __name__ == "__main__":
    main()
