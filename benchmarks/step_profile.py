"""Where a decode step's time goes: one engine on the default model, a running batch of --batch-size requests,
each step split into the linears, attention, the other layer ops (norms, RoPE + KV write, activation, embedding),
the forward's remaining Python, sampling and everything outside the forward (scheduling, block tables, inputs,
outputs), by timing those calls over --steps steps.

    python -m tandem.benchmarks.step_profile [--dtype float32] [--batch-sizes 1,32] [--kernel-threads 2]

The kernels run on --kernel-threads (a decode engine's default is every CPU), torch on one thread (as an engine).
Timers wrap module and function calls, so the parts add up to the step's time less their own small overhead.
"""
from __future__ import annotations

import argparse
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
    forward = timers.seconds
    # the model's parts: each wrapped where it is called from (the module's forward or a module-level name)
    linear_classes = set()
    for part, owner, name in (("attention", model_module, "paged_attention"),
                              ("layer ops", model_module.RMSNorm, "forward"),
                              ("layer ops", model_module.cpu_layer_ops, "rope_write_kv"),
                              ("layer ops", model_module.cpu_layer_ops, "silu_and_mul"),
                              ("layer ops", model_module, "write_kv_cache"),
                              ("forward", model_module.LlamaForCausalLM, "forward"),
                              ("sampling", runner_module, "sample"),
                              ("sampling", runner_module, "process_logits")):
        timers.wrap(owner, name, part)
    print(f"{config.weight_format}, {args.kernel_threads} kernel threads; ms per step")
    print(f"{'batch':>5} {'step':>7} {'linears':>8} {'attention':>9} {'layer ops':>9} {'fwd rest':>8} "
          f"{'sampling':>8} {'outside':>8}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        engine = LLMEngine(config, CacheConfig(16, 64 * batch, config.dtype, enable_prefix_caching=False),
                           SchedulerConfig(2048, max(batch, 1)))  # fmt: skip
        model = engine.model_runner.model
        for cls in {type(m) for m in model.modules() if hasattr(m, "in_features") and not list(m.children())}:
            linear_classes.add(cls)
        for cls in linear_classes:
            if not getattr(cls.forward, "_timed", False):
                timers.wrap(cls, "forward", "linears")
                cls.forward._timed = True
        for i in range(batch):
            engine.add_request(Request(f"r{i}", [(j * 7919 + i) % 40000 + 100 for j in range(args.prompt_len)],
                                       SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True)))
        while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        forward.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - start) / args.steps * 1e3
        ms = {k: v / args.steps * 1e3 for k, v in forward.items()}
        inside = ms["linears"] + ms["attention"] + ms["layer ops"]
        print(f"{batch:5} {step:7.2f} {ms['linears']:8.2f} {ms['attention']:9.2f} {ms['layer ops']:9.2f} "
              f"{ms['forward'] - inside:8.2f} {ms['sampling']:8.2f} {step - ms['forward'] - ms['sampling']:8.2f}")


if __name__ == "__main__":
    main()
