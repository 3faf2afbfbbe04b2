"""LoRA adapters in one engine against HF transformers + PEFT in fp32, greedy, token for token (docs/lora.md): a batch
mixing the base model and three adapters of different ranks and targets, on Llama 3 and Phi-3 (adapters of its
fused qkv_proj / gate_up_proj, as PEFT names them there), with fewer slots and memory than adapters (the scheduler's
turns, re-reads from disk); prefix-cache isolation between adapters, also while their requests run together; adapters
loaded and unloaded while requests run; a quantized (INT4) base; early-exit and draft-model speculation with
adapters. Adapters are written in the test by PEFT (tests/tiny_adapters.py)."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest

from tandem.shared.block_hash import hash_request_blocks
from tandem.shared.async_engine import AsyncEngine
from tandem.shared.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.errors import InvalidRequestError, UnknownLoRAError
from tandem.shared.lora.request import LoRARequest
from tandem.shared.request import Request, SamplingParams
from tests.tiny_adapters import hf_peft, save_adapters
from tests.tiny_models import hf_greedy, prompts_for, save_tiny

N = 16  # greedy tokens compared


class Tiny:
    """A tiny checkpoint, its adapters and memoized HF + PEFT greedy references."""

    def __init__(self, name: str, root):
        self.name = name
        self.path = save_tiny(name, root / "base")
        self.adapters = save_adapters(self.path, root, phi3=name == "phi3")
        self.config = ModelConfig.from_dir(self.path)
        self.prompts = prompts_for(1, self.config.vocab_size)
        self._models, self._tokens = {}, {}

    def expected(self, lora: str | None, ids: list[int], n: int = N) -> list[int]:
        key = (lora, tuple(ids), n)
        if key not in self._tokens:
            if lora not in self._models:
                self._models[lora] = hf_peft(self.path, self.adapters[lora] if lora else None)
            self._tokens[key] = hf_greedy(self._models[lora], ids, n)
        return self._tokens[key]

    def lora_config(self, names=("attn", "all", "mlp"), **kwargs) -> LoRAConfig:
        return LoRAConfig(lora_modules=tuple((n, str(self.adapters[n])) for n in names), **kwargs)


@pytest.fixture(scope="module")
def tiny_factory(tmp_path_factory):
    made = {}

    def get(name: str) -> Tiny:
        if name not in made:
            made[name] = Tiny(name, tmp_path_factory.mktemp(f"lora-{name}"))
        return made[name]

    return get


def make_request(request_id: str, ids: list[int], lora: str | None, n: int = N) -> Request:
    return Request(request_id, ids, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0), lora_name=lora)


def run_all(engine: LLMEngine, requests: list[Request]) -> None:
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("name", ["llama3", "qwen2", "gemma2", "phi3"])
def test_a_mixed_adapter_batch_equals_hf_peft_per_request(tiny_factory, name):
    """Base + three adapters in flight together, one prompt under two adapters; two slots and two adapters in memory
    for three adapters, so requests take turns and an adapter is read from disk again."""
    tiny = tiny_factory(name)
    p = tiny.prompts
    plan = [("p5", None), ("p16", "attn"), ("p37", "all"), ("p70", "mlp"), ("p37", "attn")]
    requests = [make_request(f"{k}-{lora}", p[k], lora) for k, lora in plan]
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(32, 8),
                       lora_config=tiny.lora_config(max_loras=2, max_cpu_loras=2))
    run_all(engine, requests)
    for r in requests:
        assert r.output_token_ids == tiny.expected(r.lora_name, r.prompt_token_ids), (name, r.request_id)
    assert tiny.expected("attn", p["p37"]) != tiny.expected(None, p["p37"])  # (the adapters change the tokens)
    assert engine.num_free_blocks == 64
    assert all(info.num_requests == 0 for info in engine.list_loras())


def test_prefix_cache_never_crosses_adapters(tiny_factory):
    """One prompt under the base model and two adapters at once: no hit across (no wait for another adapter's
    blocks in flight either: all three run from the first step); the same adapter twice at once: the second takes
    the first's blocks; later, each adapter hits only its own blocks. Every output equals HF + PEFT."""
    tiny = tiny_factory("llama3")
    ids = tiny.prompts["p70"]
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(256, 8), lora_config=tiny.lora_config())
    first = [make_request(f"first-{lora}", ids, lora) for lora in (None, "attn", "all")]
    twin = make_request("twin-attn", ids, "attn")
    for r in first + [twin]:
        engine.add_request(r)
    engine.step()
    assert [r.num_computed_tokens for r in first] == [70, 70, 70]  # (all in the first step, nothing cached)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.num_cached_tokens for r in first] == [0, 0, 0]
    assert twin.num_cached_tokens == 64
    again = [make_request(f"again-{lora}", ids + [7, 8], lora) for lora in ("attn", "all", None, "mlp")]
    run_all(engine, again)
    assert [r.num_cached_tokens >= 64 for r in again] == [True, True, True, False]
    assert again[-1].num_cached_tokens == 0  # (mlp: never computed this prompt)
    for r in first + [twin] + again:
        assert r.output_token_ids == tiny.expected(r.lora_name, r.prompt_token_ids), r.request_id
    keys = {lora: engine.lora_manager.key_of(lora) if lora else None for lora in (None, "attn", "all")}
    first_blocks = {hash_request_blocks(ids[:16], engine.hash_contract, lora_key=key)[0] for key in keys.values()}
    assert len(first_blocks) == 3 and first_blocks <= set(engine.kv_cache_manager.cached_block_hashes())


def test_adapters_load_and_unload_while_requests_run(tiny_factory):
    """An adapter loaded mid-run serves the next request; one unloaded mid-run lets its running request finish
    (exact), refuses new ones by name, and is forgotten once that request ends; loaded again from the same files, its
    requests find their blocks cached (same identity). Errors name the adapter."""
    tiny = tiny_factory("llama3")
    p = tiny.prompts
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(32, 8),
                       lora_config=tiny.lora_config(names=("attn",), max_loras=2))
    running = make_request("running", p["p70"], "attn")
    engine.add_request(running)
    engine.step()
    assert engine.add_lora(LoRARequest("all", str(tiny.adapters["all"])))
    assert not engine.add_lora(LoRARequest("all", str(tiny.adapters["all"])))  # (the same files: nothing to do)
    with pytest.raises(InvalidRequestError, match="'all' is already loaded, from other files"):
        engine.add_lora(LoRARequest("all", str(tiny.adapters["mlp"])))
    late = make_request("late", p["p37"], "all")
    engine.add_request(late)
    engine.step()
    engine.remove_lora("attn")
    with pytest.raises(UnknownLoRAError, match="'attn' is not loaded"):
        engine.add_request(make_request("refused", p["p16"], "attn"))
    with pytest.raises(UnknownLoRAError, match="'nope'"):
        engine.remove_lora("nope")
    assert [info.name for info in engine.list_loras()] == ["all"]
    while engine.has_unfinished_requests():
        engine.step()
    assert running.output_token_ids == tiny.expected("attn", p["p70"])
    assert late.output_token_ids == tiny.expected("all", p["p37"])
    assert len(engine.lora_manager.records) == 1  # ("attn" went with its last request)
    engine.add_lora(LoRARequest("attn", str(tiny.adapters["attn"])))
    back = make_request("back", p["p70"], "attn")
    run_all(engine, [back])
    assert back.num_cached_tokens >= 64 and back.output_token_ids == tiny.expected("attn", p["p70"])


def test_the_async_engine_loads_and_unloads_adapters_between_steps(tiny_factory):
    """Through AsyncEngine's commands (the services' path; the engine thread steps meanwhile): load while a request
    of another adapter streams, unload that adapter under it (it finishes exact), refuse a new request naming it."""
    tiny = tiny_factory("llama3")
    p = tiny.prompts
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(16, 8),
                       lora_config=tiny.lora_config(names=("attn",)))

    async def collect(stream) -> list[int]:
        tokens = []
        while (out := await stream.get()) is not None:
            tokens += out.new_token_ids
        return tokens

    async def scenario():
        async_engine = AsyncEngine(engine, asyncio.get_running_loop())
        try:
            first = await async_engine.add_request(make_request("first", p["p70"], "attn"))
            assert await async_engine.add_lora(LoRARequest("all", str(tiny.adapters["all"])))
            await async_engine.remove_lora("attn")
            with pytest.raises(UnknownLoRAError, match="'attn'"):
                await async_engine.add_request(make_request("refused", p["p16"], "attn"))
            second = await async_engine.add_request(make_request("second", p["p37"], "all"))
            tokens = await collect(first), await collect(second)
            return tokens, [info.name for info in await async_engine.list_loras()]
        finally:
            async_engine.stop()

    (first, second), names = asyncio.run(scenario())
    assert first == tiny.expected("attn", p["p70"]) and second == tiny.expected("all", p["p37"])
    assert names == ["all"]


def test_unknown_adapters_and_engines_without_lora_refuse_by_name(tiny_factory):
    tiny = tiny_factory("llama3")
    ids = tiny.prompts["p16"]
    plain = LLMEngine(tiny.config, CacheConfig(16, 16), SchedulerConfig(32, 8))
    assert plain.model_runner.lora_manager is None and plain.list_loras() == []
    assert not any("LoRA" in type(m).__name__ for m in plain.model_runner.model.modules())  # (no wrappers, no cost)
    with pytest.raises(UnknownLoRAError, match="adapter 'attn' is not loaded: this engine serves no LoRA adapters"):
        plain.add_request(make_request("r", ids, "attn"))
    with pytest.raises(InvalidRequestError, match="adapter 'attn': this engine serves no LoRA adapters"):
        plain.add_lora(LoRARequest("attn", str(tiny.adapters["attn"])))
    engine = LLMEngine(tiny.config, CacheConfig(16, 16), SchedulerConfig(32, 8), lora_config=LoRAConfig())
    with pytest.raises(UnknownLoRAError, match="adapter 'ghost' is not loaded"):
        engine.add_request(make_request("r", ids, "ghost"))
    assert not engine.has_unfinished_requests() and engine.requests == {}


def test_an_adapter_whose_files_changed_on_disk_fails_its_requests_alone(tiny_factory, tmp_path):
    """One adapter in memory: "attn" is dropped when "all" loads; its files then change, so reading it again for a
    request fails that request (its error says why) and unloads it, while a base-model request in the same steps
    goes on exact."""
    import shutil

    tiny = tiny_factory("llama3")
    p = tiny.prompts
    moved = shutil.copytree(tiny.adapters["attn"], tmp_path / "attn")
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(64, 8),
                       lora_config=LoRAConfig(max_loras=1, max_cpu_loras=1,
                                              lora_modules=(("attn", str(moved)), ("all", str(tiny.adapters["all"])))))
    (moved / "adapter_config.json").write_text((moved / "adapter_config.json").read_text().replace("16", "17"))
    broken, base = make_request("broken", p["p37"], "attn"), make_request("base", p["p16"], None)
    for r in (broken, base):
        engine.add_request(r)
    outputs = engine.step()
    failed = next(o for o in outputs if o.request_id == "broken")
    assert failed.finished and "changed since it was loaded" in failed.error and failed.new_token_ids == []
    assert [info.name for info in engine.list_loras()] == ["all"] and engine.lora_manager.records.keys() == {
        engine.lora_manager.key_of("all")}
    while engine.has_unfinished_requests():
        engine.step()
    assert base.output_token_ids == tiny.expected(None, p["p16"])
    assert engine.num_free_blocks == 64 and engine.kv_cache_manager.cached_block_hashes() != []


def test_a_quantized_base_with_adapters_equals_hf_peft_over_the_same_quantized_layers(tiny_factory, tmp_path):
    """INT4 (RTN, groups of 64) base weights: the delta is added to the quantized linears' output. The reference is
    HF + PEFT whose base linears are the same quantized layers (apply_quantization's, swapped in under PEFT's)."""
    from tandem.shared.quant import apply_quantization
    from tandem.shared.quant.modules import quantizable_linears
    from tandem.tools.quantize import main

    tiny = tiny_factory("llama3")
    out = tmp_path / "int4"
    assert main(["--method", "rtn", "--bits", "4", "--group-size", "64", "--model", str(tiny.path), "--out",
                 str(out)]) == 0
    config = ModelConfig.from_dir(out)
    assert config.weight_format.startswith("int4-g64")
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8),
                       lora_config=tiny.lora_config(names=("attn", "all")))
    plan = [("p16", None), ("p37", "attn"), ("p70", "all")]
    requests = [make_request(f"{k}-{lora}", tiny.prompts[k], lora) for k, lora in plan]
    run_all(engine, requests)
    quantized = hf_peft(tiny.path, None)
    apply_quantization(quantized, out)
    for r in requests:
        reference = hf_peft(tiny.path, tiny.adapters[r.lora_name] if r.lora_name else None)
        for name, layer in quantizable_linears(quantized).items():
            parent, _, attr = name.partition(".")[2].rpartition(".")
            module = reference.get_submodule(f"base_model.model.model.{parent}" if r.lora_name else f"model.{parent}")
            target = getattr(module, attr)
            if hasattr(target, "base_layer"):  # (a PEFT LoRA layer: its base becomes the quantized one)
                target.base_layer = layer
            else:
                setattr(module, attr, layer)
        assert r.output_token_ids == hf_greedy(reference, r.prompt_token_ids, N), r.request_id
    assert any(r.output_token_ids != tiny.expected(r.lora_name, r.prompt_token_ids) for r in requests)  # (INT4 shows)


@pytest.mark.parametrize("method", ["early-exit", "draft"])
def test_speculation_with_adapters_keeps_hf_peft_tokens(tiny_factory, method):
    """Early exit drafts with the model's first layer and the request's adapter; a draft model (the base checkpoint
    itself here) drafts without adapters. Greedy verification keeps each request's HF + PEFT tokens either way."""
    tiny = tiny_factory("llama3")
    spec = SpeculativeConfig(method, num_speculative_tokens=3, adaptive=False,
                             draft_model=str(tiny.path) if method == "draft" else None,
                             draft_num_layers=1 if method == "early-exit" else None)
    engine = LLMEngine(tiny.config, CacheConfig(16, 64), SchedulerConfig(64, 8), speculative_config=spec,
                       lora_config=tiny.lora_config(names=("attn", "all")))
    plan = [("p16", None), ("p37", "attn"), ("p70", "all")]
    requests = [make_request(f"{k}-{lora}", tiny.prompts[k], lora) for k, lora in plan]
    run_all(engine, requests)
    for r in requests:
        assert r.output_token_ids == tiny.expected(r.lora_name, r.prompt_token_ids), (method, r.request_id)
    assert engine.stats().spec_num_draft_tokens > 0


@pytest.mark.parametrize("changes, error", [({"rank_pattern": {"([": 4}}, "rank_pattern: '\\(\\[' is not a valid"),
                                            ({"target_modules": 123}, "target_modules must be a regex")])
def test_a_malformed_adapter_of_lora_modules_is_a_one_line_start_up_error(tiny_factory, tmp_path, changes, error):
    """The engine service refuses to start: `error: adapter 'bad' (...): <field> ...`, exit 1, no traceback."""
    tiny = tiny_factory("llama3")
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((tiny.adapters["attn"] / "adapter_config.json").read_text()) | changes
    (bad / "adapter_config.json").write_text(json.dumps(config))
    (bad / "adapter_model.safetensors").write_bytes((tiny.adapters["attn"] / "adapter_model.safetensors").read_bytes())
    result = subprocess.run([sys.executable, "-P", "-m", "tandem.services.prefill", "--standalone", "--port", "0",
                             "--model", str(tiny.path), "--lora-modules", f"bad={bad}"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: adapter 'bad' (") and re.search(error, last), last
