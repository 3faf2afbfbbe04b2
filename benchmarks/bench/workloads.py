"""Workloads: seeded, deterministic sets of benchmark requests whose prompts are cut from shipped English text.

A workload is one function (rng, num_prompts, input_len, output_len) -> [(prompt_len, output_len)] in tokens,
registered in WORKLOADS. build_requests turns those lengths into prompts: windows of the model's tokens of
tools/data/quant_eval.txt + quant_calibration.txt, cut at token boundaries and decoded back to text, so a raw
prompt re-tokenizes (as the gateway does: no special tokens) to the wanted length. Every request is greedy with
ignore_eos, so each produces exactly output_len tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

FIXED_INPUT_LEN = 1000  # tokens: the TTFT comparison of 1,000-token prompts
FIXED_OUTPUT_LEN = 16
MAX_CUT_TRIES = 16  # windows tried per prompt until one re-tokenizes to exactly the wanted length


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload, the same for every backend and load level.

    prompt: raw text (what the gateway gets); prompt_token_ids: tokenizer(prompt, add_special_tokens=False), the
    ids the gateway computes from it (what the in-process backends and llama-server get); output_len: max_tokens,
    the number of tokens generated (greedy, ignore_eos).
    """

    index: int
    prompt: str
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


LengthPairs = list[tuple[int, int]]  # [(prompt_len, output_len)] in tokens, one per request


def decode_heavy(rng: random.Random, num_prompts: int, input_len: int | None, output_len: int | None) -> LengthPairs:
    """Short prompts, long answers: prompt 20-60 tokens (uniform), 128 output tokens. Ignores the lengths."""
    return [(rng.randint(20, 60), 128) for _ in range(num_prompts)]


def mixed(rng: random.Random, num_prompts: int, input_len: int | None, output_len: int | None) -> LengthPairs:
    """Prompt 65-540 tokens (uniform); 80% of the outputs 16 tokens, 20% 128 (round(0.2 n) of them, at shuffled
    positions). Ignores the lengths."""
    num_long = round(0.2 * num_prompts)
    outputs = [128] * num_long + [16] * (num_prompts - num_long)
    rng.shuffle(outputs)
    return [(rng.randint(65, 540), out) for out in outputs]


COPY_ECHO_TOKENS = 16  # copy: the passage's first tokens, repeated after it


def copy(rng: random.Random, num_prompts: int, input_len: int | None, output_len: int | None) -> LengthPairs:
    """Copy-heavy (code edits, quoting agents): a passage of 100-300 tokens (uniform), then its first
    COPY_ECHO_TOKENS tokens again, so the likely answer repeats the passage: what speculative decoding gains most
    on. output_len tokens out (default 40; 128 for long answers). Ignores input_len."""
    return [(rng.randint(100, 300), output_len or 40) for _ in range(num_prompts)]


def fixed(rng: random.Random, num_prompts: int, input_len: int | None, output_len: int | None) -> LengthPairs:
    """Every request input_len prompt tokens (default 1000) and output_len output tokens (default 16)."""
    pair = (input_len or FIXED_INPUT_LEN, output_len or FIXED_OUTPUT_LEN)
    return [pair] * num_prompts


WORKLOADS: dict[str, Callable[..., LengthPairs]] = {
    "decode-heavy": decode_heavy,
    "mixed": mixed,
    "fixed": fixed,
    "copy": copy,
}


def corpus_token_ids(tokenizer) -> list[int]:
    """The shipped English texts as the model's tokens (no special tokens)."""
    from tandem.tools.evaluation import CALIBRATION_TEXT, EVAL_TEXT  # imports torch: only when requests are built

    text = EVAL_TEXT.read_text() + "\n\n" + CALIBRATION_TEXT.read_text()
    return tokenizer(text, add_special_tokens=False).input_ids


def cut_prompt(tokenizer, corpus: list[int], length: int, rng: random.Random) -> tuple[str, list[int]]:
    """A window of `length` corpus tokens decoded to text, and that text's own tokens.

    Decoding then encoding can merge or split tokens at the window's edges; windows starting one token later
    are tried until one comes back at exactly `length` tokens (the last one is kept if none does: exact-ish).
    The corpus repeats when `length` exceeds it.
    """
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    repeats = -(-(length + MAX_CUT_TRIES) // len(corpus)) + 1
    tokens = corpus * repeats
    start = rng.randrange(len(corpus))
    for shift in range(MAX_CUT_TRIES):
        text = tokenizer.decode(tokens[start + shift : start + shift + length], clean_up_tokenization_spaces=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) == length:
            break
    return text, ids


def build_requests(workload: str, tokenizer, num_prompts: int, seed: int, input_len: int | None = None,
                   output_len: int | None = None) -> list[BenchRequest]:
    """num_prompts requests of the named workload; the same seed gives the same requests. ValueError on an unknown
    workload name."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    lengths = WORKLOADS[workload](rng, num_prompts, input_len, output_len)
    corpus = corpus_token_ids(tokenizer)
    requests = []
    for index, (prompt_len, out_len) in enumerate(lengths):
        text, ids = cut_prompt(tokenizer, corpus, prompt_len, rng)
        if workload == "copy":  # (the passage, a blank line, its start again)
            text += "\n\n" + tokenizer.decode(ids[:COPY_ECHO_TOKENS], clean_up_tokenization_spaces=False)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        requests.append(BenchRequest(index, text, tuple(ids), out_len))
    return requests
