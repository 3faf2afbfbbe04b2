"""Each architecture the engine serves (shared/architectures.py), on a tiny checkpoint transformers writes in the
test (tests/tiny_models.py), greedy in fp32 against HF transformers' own modeling code, token for token: prompts
crossing block boundaries and sliding windows, chunked prefill at two chunk sizes, a batch of prompts in flight
together, prefix-cache hits (a prompt extending another one, at and off a block boundary), n-gram speculation;
every prompt position's log-probability against HF's (which also sees Gemma 2's final soft-capping, invisible to
greedy tokens). What the engine does not do is refused at start with the field named. Through a real cluster
(gateway, prefill, decode, Redis; every prompt's KV shipped from the prefill, speculative decoding on the decode, a
prompt extending another): Gemma 3 in make test, the others in .ci/run's heavy pass."""
import json
import re

import pytest
import torch

from tandem.shared.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams
from tests.prompts import LONG_TEXT
from tests.tiny_models import (NUM_TOKENS, TINY_MODELS, WINDOW, hf_greedy, prefill_then_decode, prompts_for, run,
                               save_tiny)

@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request, tmp_path_factory):
    """(name, checkpoint dir, HF model in fp32)."""
    from transformers import AutoModelForCausalLM

    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("chunk", [16, 48])
def test_greedy_equals_hf_in_a_batch_with_chunked_prefill(tiny, chunk):
    name, path, hf = tiny
    config = ModelConfig.from_dir(path)
    prompts = prompts_for(1, config.vocab_size)
    expected = {k: hf_greedy(hf, ids, NUM_TOKENS) for k, ids in prompts.items()}
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(chunk, 8))
    assert run(engine, prompts) == expected, name
    assert engine.num_free_blocks == 64


def test_ngram_speculation_equals_hf(tiny):
    """Prompts holding half the vocabulary, and lookups of a single token, so the n-gram proposer drafts at most
    steps (random weights seldom repeat longer n-grams): the verification forward (several query rows a request,
    each with its own window) keeps HF's tokens."""
    name, path, hf = tiny
    config = ModelConfig.from_dir(path)
    g = torch.Generator().manual_seed(4)
    prompts = {f"x{i}": (torch.randperm(config.vocab_size - 3, generator=g)[:256] + 3).tolist()
               for i in range(2)}  # (ids 0-2 are special: HF's generate would take a 0 for padding)
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(64, 8), speculative_config=spec)
    assert run(engine, prompts) == {k: hf_greedy(hf, ids, NUM_TOKENS) for k, ids in prompts.items()}, name
    assert engine.stats().spec_num_draft_tokens >= 8


def prompt_logprobs(config: ModelConfig, ids: list[int], top: int) -> Request:
    """The finished request of ids with prompt_logprobs=top, in an engine of its own."""
    request = Request("p", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top))
    engine = LLMEngine(config, CacheConfig(16, 64, config.dtype), SchedulerConfig(32, 8))
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def test_prompt_logprobs_equal_hf(tiny):
    """Each prompt position's distribution, past the window too: the log-probability of the next prompt token
    and the top 3, against HF's log_softmax of its logits."""
    name, path, hf = tiny
    config = ModelConfig.from_dir(path)
    ids = prompts_for(5, config.vocab_size)["p70"]
    request = prompt_logprobs(config, ids, 3)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)  # [69, vocab]
    got = torch.tensor([lp.logprob for lp in request.prompt_logprobs])
    torch.testing.assert_close(got, expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=2e-4, rtol=0)
    top = expected.topk(3)
    assert [[t for t, _ in lp.top] for lp in request.prompt_logprobs] == top.indices.tolist(), name


def test_bf16_is_as_close_to_fp32_as_hf_in_bf16(tiny):
    """bf16 (weights, activations, KV): bf16 cannot be token-exact against any reference, so each prompt
    position's log-probability is compared with HF in fp32 over the same bf16-rounded weights; the engine's mean
    error must stay within twice that of HF's own bf16 run."""
    from transformers import AutoModelForCausalLM

    name, path, _ = tiny
    config = ModelConfig.from_dir(path, dtype="bfloat16")
    ids = prompts_for(5, config.vocab_size)["p70"]
    request = prompt_logprobs(config, ids, 0)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    targets = torch.tensor(ids[1:])[:, None]

    def logprobs(model) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1).gather(1, targets)[:, 0]

    hf_in_bf16 = logprobs(hf_bf16)
    reference = logprobs(hf_bf16.float())  # (the same bf16-rounded weights, computed in fp32)
    hf_error = (hf_in_bf16 - reference).abs().mean()
    error = (torch.tensor([lp.logprob for lp in request.prompt_logprobs]) - reference).abs().mean()
    assert error <= 2 * hf_error, (name, float(error), float(hf_error))


def test_prefix_cache_hits_equal_hf(tiny):
    name, path, hf = tiny
    config = ModelConfig.from_dir(path)
    base = prompts_for(2, config.vocab_size)["p70"]
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    run(engine, {"warm": base[:48]}, n=1)  # caches 3 full blocks
    for cut in (48, 49, 64, 70):  # at a block boundary, one past it, the next boundary, mid-block
        ids = base[:cut]
        assert run(engine, {f"hit{cut}": ids}) == {f"hit{cut}": hf_greedy(hf, ids, NUM_TOKENS)}, (name, cut)
    assert engine.stats().prefix_cache_hits > 0


def test_blocks_before_the_window_are_freed_and_the_decode_is_sent_only_its_window(tmp_path):
    """Mistral (every layer slides, window 24): a request holds only its window's blocks once past them, a
    prompt repeating it still hits the freed (cached) blocks, and a prefill -> decode transfer ships only the
    blocks the decode's window needs; every output equals HF's."""
    from transformers import AutoModelForCausalLM

    path = save_tiny("mistral", tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ModelConfig.from_dir(path)
    ids = prompts_for(6, config.vocab_size)["p70"] * 3  # 210 tokens: 14 blocks, the window spans at most 3
    expected = hf_greedy(hf, ids, NUM_TOKENS)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    request = Request("a", ids, SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0))
    engine.add_request(request)
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_held = max(most_held, 64 - engine.num_free_blocks)
    assert request.output_token_ids == expected and most_held <= 5  # (3 of the window, 2 of the next chunk)
    assert run(engine, {"b": ids}) == {"b": expected} and engine.stats().prefix_cache_hits > 0

    prefill = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8), export_kv=True)
    decode = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))

    def reserved(receiving: Request) -> None:  # the 3 blocks of the window are held, the 11 before it not
        assert receiving.kv_skip_blocks == (209 - 24 + 1) // 16 == 11 and decode.num_free_blocks == 64 - (14 - 11)

    assert prefill_then_decode(prefill, decode, ids, reserved).output_token_ids == expected
    assert prefill.kv_connector.num_blocks_exported == decode.kv_connector.num_blocks_imported == 3


def test_longrope_takes_the_long_factors_past_the_original_context_as_hf_does(tmp_path):
    """LongRoPE (original context 64 here): prompts within it use the short factors and, once a sequence grows past
    it, are computed again with the long ones (HF's Phi-3 drops its cache there); longer prompts use the long ones
    throughout. Prompts sharing their first 48 tokens across that line never share blocks (the block hashes carry
    the variant); n-gram drafts stop short of the line. Every output equals HF's."""
    from transformers import AutoModelForCausalLM

    path = save_tiny("phi3-longrope", tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ModelConfig.from_dir(path)
    assert config.longrope_context == 64
    g = torch.Generator().manual_seed(3)
    base = (torch.randperm(config.vocab_size - 3, generator=g)[:120] + 3).tolist()
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8), speculative_config=spec)
    for n in (50, 100, 64, 65, 63):  # (in turn: each later prompt finds the earlier ones' first blocks cached)
        assert run(engine, {f"p{n}": base[:n]}) == {f"p{n}": hf_greedy(hf, base[:n], NUM_TOKENS)}, n
    stats = engine.stats()
    assert stats.num_preemptions == 3 and stats.spec_num_draft_tokens > 0 and stats.prefix_cache_hits > 0
    # disaggregated: the prefill computes 60 short tokens; the decode crosses the line and computes it all again
    prefill = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8), export_kv=True)
    decode = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    ids = base[60:120]
    assert prefill_then_decode(prefill, decode, ids).output_token_ids == hf_greedy(hf, ids, NUM_TOKENS)
    assert decode.stats().num_preemptions == 1


def test_a_window_of_one_serves_through_the_p_d_transfer(tmp_path):
    """A window of 1 (each position sees itself alone): a 32-token prompt, two whole blocks, still gets the block
    of its last token from the prefill (the prefill's rule), and the decode's tokens equal the prefill's own."""
    path = save_tiny("mistral", tmp_path / "m")
    config = json.loads((path / "config.json").read_text()) | {"sliding_window": 1}
    (path / "config.json").write_text(json.dumps(config))
    config = ModelConfig.from_dir(path)
    ids = prompts_for(8, config.vocab_size)["p70"][:32]
    alone = LLMEngine(config, CacheConfig(16, 8), SchedulerConfig(32, 8))
    expected = run(alone, {"c": ids})["c"]
    prefill = LLMEngine(config, CacheConfig(16, 8), SchedulerConfig(32, 8), export_kv=True)
    decode = LLMEngine(config, CacheConfig(16, 8), SchedulerConfig(32, 8))

    def reserved(receiving: Request) -> None:  # (of 2 blocks: at most those before the prompt's last token)
        assert receiving.kv_skip_blocks == 1

    assert prefill_then_decode(prefill, decode, ids, reserved).output_token_ids == expected
    assert decode.num_free_blocks == 8


@pytest.mark.parametrize("name", ["phi3", "gemma2"])
def test_a_sharded_bf16_checkpoint_equals_hf(tmp_path, name):
    """The form most checkpoints come in: bf16 weights in several safetensors shards with an index (Phi-3's fused
    projections and Gemma's norms among them), served in fp32 against HF fp32 on the same file."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(save_tiny(name, tmp_path / "fp32"), dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16", max_shard_size="300KB")
    path = tmp_path / "bf16"
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ModelConfig.from_dir(path)
    prompts = prompts_for(7, config.vocab_size)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    assert run(engine, prompts) == {k: hf_greedy(hf, ids, NUM_TOKENS) for k, ids in prompts.items()}


def test_generation_config_sampling_defaults_fill_what_a_request_leaves_unset(tmp_path):
    """generation_config.json's temperature, top_p, top_k, repetition_penalty and max_new_tokens become the
    defaults of a request's unset fields at the gateway (vLLM's --generation-config auto); set fields win, beam
    search stays greedy, and the model id does not change (no KV does)."""
    from tandem.services.gateway.validation import check_sampling_params
    from tandem.v1 import common_pb2

    path = save_tiny("qwen3", tmp_path / "m")
    before = ModelConfig.from_dir(path).model_id
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
                  "max_new_tokens": 40}
    (path / "generation_config.json").write_text(json.dumps(generation))
    config = ModelConfig.from_dir(path)
    assert config.model_id == before
    plain = check_sampling_params(common_pb2.SamplingParams(), 10, config, default_max_tokens=16)
    got = (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty, plain.max_tokens)
    assert got == pytest.approx((0.6, 0.95, 20, 1.1, 40))  # (float fields are fp32 in the proto)
    own = check_sampling_params(common_pb2.SamplingParams(temperature=0.0, max_tokens=5), 10, config, 16)
    assert (own.temperature, own.max_tokens, own.top_k) == (0.0, 5, 20)
    beam = check_sampling_params(common_pb2.SamplingParams(beam_width=2, max_tokens=4), 10, config, 16)
    assert not beam.HasField("temperature") and not beam.HasField("top_k")
    (path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="generation_config.json: temperature must be a number"):
        ModelConfig.from_dir(path)


def test_architecture_is_part_of_the_model_id(tmp_path):
    """Two checkpoints with the same weights but another architecture (here: Qwen2's config read as Llama's, which
    would drop the q/k/v biases) never share a model id, so their tiers never exchange KV."""
    path = save_tiny("qwen2", tmp_path / "qwen2")
    config = json.loads((path / "config.json").read_text())
    other = tmp_path / "as-llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(config | {"model_type": "llama", "attention_bias": False}))
    (other / "model.safetensors").symlink_to(path / "model.safetensors")
    assert ModelConfig.from_dir(path).model_id != ModelConfig.from_dir(other).model_id


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: ['gemma2', 'gemma3_text', 'llama', "
                             "'mistral', 'phi3', 'qwen2', 'qwen3']"),
    ({"model_type": "gemma3"}, "the multimodal Gemma 3; its text model is model_type gemma3_text"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3,
                          "long_factor": [2.0] * 32}}, "rope_parameters.short_factor must list head_dim / 2 = 32"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"eos_token_id": 32000}, "eos_token_id [32000] (config.json, generation_config.json) is outside the vocabulary"),
    ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 2}, "layer_types ['chunked_attention']"),
    ({"sliding_window": 8, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"model_type": "gemma2", "attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": None}, "query_pre_attn_scalar must be a positive number"),
    ({"model_type": "gemma2", "final_logit_softcapping": float("inf")}, "final_logit_softcapping must be a positive"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0, "layer_types": None},
     "sliding_window_pattern must be a positive integer, got 0"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number"),
    ({"head_dim": -64}, "head_dim must be a positive integer"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
])  # fmt: skip
def test_what_the_engine_does_not_do_is_refused_by_name(tmp_path, change, words):
    path = save_tiny("llama3", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=re.escape(words)):
        ModelConfig.from_dir(path)


@pytest.mark.parametrize("name, windows", [
    ("mistral", [WINDOW, WINDOW]), ("qwen2-window", [None, WINDOW]),  # every layer; from max_window_layers on
    ("gemma2", [WINDOW, None]), ("gemma3", [WINDOW, WINDOW, None]), ("qwen2", [None, None]),
])  # fmt: skip
def test_sliding_windows_are_read_per_layer(tmp_path, name, windows):
    """Which layers slide, as HF's config sets it; the context is the checkpoint's whole, not capped at the
    window (the kernels attend within it)."""
    config = ModelConfig.from_dir(save_tiny(name, tmp_path / name))
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == windows
    assert config.max_model_len == 1024


@pytest.mark.parametrize("name", [n if n == "gemma3" else pytest.param(n, marks=pytest.mark.heavy)
                                  for n in sorted(TINY_MODELS)])  # fmt: skip
def test_through_a_cluster_with_kv_transfer_prefix_hits_and_speculation(name, model_dir, tokenizer, tmp_path):
    from tandem.services.client import generate, make_request
    from tandem.services.launcher import LocalCluster
    from tandem.shared.request import StructuredOutputParams
    from tandem.shared.structured_output import grammar_for
    from tandem.v1 import common_pb2
    from tests.integration.helpers import hf_constrained
    from transformers import AutoModelForCausalLM

    path = save_tiny(name, tmp_path / name, tokenizer_from=model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["one two three four, " * 6 + "one two", LONG_TEXT[:300], LONG_TEXT[:300] + " And then,"]
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"  # (and a structured-output request: its first token on the prefill)
    constrained = make_request(LONG_TEXT[:200] + " The date:", raw=True, max_tokens=NUM_TOKENS, temperature=0.0)
    constrained.sampling_params.structured_output.CopyFrom(common_pb2.StructuredOutput(regex=date))
    engine = ["--num-blocks", "256", "--threads", "1"]
    # (early exit after 1 of the 2 layers: drafts in every step; random weights seldom repeat, so n-gram drafts
    # would seldom come; n-gram speculation is checked in one engine above)
    spec = ["--speculative-method", "early-exit", "--draft-num-layers", "1", "--num-speculative-tokens", "4",
            "--no-speculative-adaptive"]
    with LocalCluster(str(path), prefill_args=engine + ["--max-num-batched-tokens", "32"], decode_args=engine + spec,
                      gateway_args=["--local-prefill-tokens", "0"]) as cluster:  # fmt: skip
        outs = [generate(cluster.gateway_address, make_request(text, raw=True, max_tokens=NUM_TOKENS,
                                                                temperature=0.0), timeout=300) for text in texts]
        structured = generate(cluster.gateway_address, constrained, timeout=300)
    for text, out in zip(texts, outs):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        with torch.inference_mode():  # (HF stops at an EOS, as the engine does)
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)[0, len(ids):]
        assert out.token_ids == expected.tolist(), (name, text[:40])
    assert outs[2].cached_tokens >= 48, "the third prompt extends the second: its 3 leading blocks are cached"
    assert sum(o.num_draft_tokens for o in outs) > 0
    ids = tokenizer(LONG_TEXT[:200] + " The date:", add_special_tokens=False).input_ids
    grammar = grammar_for(StructuredOutputParams(regex=date))
    assert structured.token_ids == hf_constrained(hf, ModelConfig.from_dir(path), ids, grammar, NUM_TOKENS), name
    assert re.fullmatch(date, structured.text), structured.text


# (through the `tandem quantize` command, a process each: Gemma 3 INT4 in make test, the rest in the heavy pass;
# test_architecture_formats.py quantizes every family in process)
@pytest.mark.parametrize("name, bits", [
    pytest.param(name, bits, marks=() if (name, bits[1]) == ("gemma3", "4") else pytest.mark.heavy,
                 id=f"{'int8' if bits[1] == '8' else 'int4-g64'}-{name}")
    for name in ("qwen2", "qwen3", "gemma3") for bits in (["--bits", "8"], ["--bits", "4", "--group-size", "64"])
])  # fmt: skip
def test_quantized_checkpoints_equal_hf_over_the_same_quantized_layers(name, bits, tmp_path):
    """`tandem quantize` (RTN) of the architecture, served by the engine, gives HF's greedy tokens when HF's own
    modeling code runs the same quantized linears (apply_quantization swaps them into the HF model by name)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from tandem.shared.quant import apply_quantization

    path, out = save_tiny(name, tmp_path / name), tmp_path / "quantized"
    subprocess.run([sys.executable, "-m", "tandem.services", "quantize", "--method", "rtn", *bits, "--model", str(path),
                    "--out", str(out)], check=True, timeout=300)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    apply_quantization(hf, out)
    config = ModelConfig.from_dir(out)
    assert config.weight_format.startswith("int8" if bits[1] == "8" else "int4-g64")
    prompts = prompts_for(3, config.vocab_size)
    engine = LLMEngine(config, CacheConfig(16, 64), SchedulerConfig(32, 8))
    assert run(engine, prompts) == {k: hf_greedy(hf, ids, NUM_TOKENS) for k, ids in prompts.items()}
