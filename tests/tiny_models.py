"""Tiny checkpoints of each architecture the engine serves, written by HF transformers itself (random weights,
`save_pretrained`, no download), with the family's config features switched on: rope scaling, q/k/v bias, q/k
norms with an explicit head_dim, sliding windows (24 tokens, shorter than the prompts) on every layer or on some,
Gemma's soft-capping (caps low enough to bite), query_pre_attn_scalar and per-layer-type RoPE. Shared by the tests
that serve them, with what they compare: greedy runs of the engine and of HF on random prompts."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.shared.engine import LLMEngine
from tandem.shared.request import Request, SamplingParams

# 2 layers, 4 query heads over 2 KV heads of 64 (the head size the CPU kernels are built for), a vocabulary of 512
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
             initializer_range=0.1)  # (wider than HF's 0.02: decisive logits, so greedy ties are unlikely)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

WINDOW = 24  # sliding windows: shorter than most test prompts, across 16-token blocks

# name -> (transformers config class name, its arguments beyond SMALL). (Gemma unties its embeddings here: tied,
# random ones times sqrt(hidden_size) swamp the layers and every output repeats the last token.)
TINY_MODELS = {
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 4.0}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 256}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 64, "hidden_size": 192, "num_attention_heads": 4}),  # 64 != 192 / 4
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "phi3": ("Phi3Config", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
    # Phi-3 128k's LongRoPE, its original context cut to 64: prompts past it take the long factors throughout
    "phi3-longrope": ("Phi3Config", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                                     "original_max_position_embeddings": 64, "rope_parameters": {
                                         "rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0 + i / 32 for i in range(32)],
                                         "long_factor": [1.0 + i / 4 for i in range(32)]}}),
    # layer 0 slides, layer 1 is global (HF's default alternation)
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "attn_logit_softcapping": 4.0,
                                "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 48,
                                "tie_word_embeddings": False}),
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": WINDOW, "query_pre_attn_scalar": 48, "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_tiny(name: str, out: Path, seed: int = 0, tokenizer_from: Path | None = None,
              overrides: dict | None = None) -> Path:
    """Write TINY_MODELS[name] with random weights (seeded) in fp32 to out; returns out. tokenizer_from: a model
    directory whose tokenizer files are copied in (the vocabulary grows to that tokenizer's, 49,152 for the
    default model's), so that a cluster's gateway can serve it. overrides: config arguments over the family's."""
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, extra = TINY_MODELS[name]
    args = SMALL | extra | (overrides or {})
    if tokenizer_from is not None:
        out.mkdir(parents=True, exist_ok=True)
        for file in TOKENIZER_FILES:
            if (Path(tokenizer_from) / file).exists():
                (out / file).write_bytes((Path(tokenizer_from) / file).read_bytes())
        args["vocab_size"] = json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"]
    config = getattr(transformers, class_name)(**args)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms other than all-ones and biases other than zero, so one applied wrongly shows
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


NUM_TOKENS = 24  # greedy tokens the tests compare


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF transformers' n greedy tokens after ids (EOS held back: random weights)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)  # (random weights: EOS is held back, n tokens each)
    return out[0, len(ids):].tolist()


GREEDY_TIE = 1e-3  # logits closer than this are a tie that two correct fp32 forwards may break either way


def assert_greedy_equal(got: dict[str, list[int]], model, prompts: dict[str, list[int]], n: int = NUM_TOKENS):
    """The engine's greedy tokens (got) equal HF's (model) for each prompt, token for token, up to a tie: where they
    first differ, HF's logits for its token and for the engine's must be within GREEDY_TIE (then the answers go
    their own ways and the rest is not compared; vLLM's check_logprobs_close also stops there, asking only that each
    token be among the other side's top log-probabilities). Why: on random weights a
    step now and then has two logits 1e-4 apart (measured: Phi-3 GPTQ, 3.89095 against 3.89084 on one torch
    thread), and the engine's attention and norms round differently from HF's in the last bits."""
    for name, ids in prompts.items():
        expected = hf_greedy(model, ids, n)
        if got[name] == expected:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got[name], expected)) if a != b), min(len(got[name]), n))
        assert i < min(len(got[name]), n), (name, got[name], expected)  # (a shorter answer is no tie)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + expected[:i]])).logits[0, -1]
        gap = (logits[expected[i]] - logits[got[name][i]]).item()
        assert gap <= GREEDY_TIE, (name, i, got[name], expected, gap)


def run(engine: LLMEngine, prompts: dict[str, list[int]], n: int = NUM_TOKENS) -> dict[str, list[int]]:
    """The engine's n greedy tokens per prompt, all in flight together."""
    requests = [Request(name, ids, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0))
                for name, ids in prompts.items()]  # fmt: skip (min_tokens: EOS held back, as HF's min_new_tokens)
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return {r.request_id: r.output_token_ids for r in requests}


def prompts_for(seed: int, vocab: int) -> dict[str, list[int]]:
    """Random prompts of 5, 16, 37 and 70 tokens (ids from 3: 0-2 are special)."""
    g = torch.Generator().manual_seed(seed)
    return {f"p{length}": torch.randint(3, vocab, (length,), generator=g).tolist() for length in (5, 16, 37, 70)}


def prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, ids: list[int], reserved=None,
                        n: int = NUM_TOKENS) -> Request:
    """ids through a prefill engine (export_kv) and a decode engine as the tiers run them: the decode reserves
    (reserved(its request) runs then), the prefill skips the blocks the decode said it needs not, each step's KV
    is imported as it comes, the prefill's first token finishes the import, and the decode runs to n greedy
    tokens (EOS held back). Returns the decode's request (its output starts with the prefill's token)."""
    receiving = Request("p-d", ids, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0))
    decode.reserve(receiving)
    if reserved is not None:
        reserved(receiving)
    sending = Request("p-d", ids, SamplingParams(max_tokens=1, temperature=0.0))
    sending.kv_skip_blocks = receiving.kv_skip_blocks
    prefill.add_request(sending)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            if out.kv is not None:
                decode.import_kv("p-d", out.kv)
            first = out.new_token_ids[0] if out.new_token_ids else first
    decode.finish_kv_import("p-d", first)
    while decode.has_unfinished_requests():
        decode.step()
    return receiving
