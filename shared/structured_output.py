"""Structured output: a grammar constrains each sampled token, on both tiers, with llguidance.

Why llguidance (over xgrammar and outlines-core): it computes a token mask for JSON schemas, regexes and Lark
grammars lazily from a token trie in tens of microseconds on CPU, with no precompilation per grammar (a schema
arriving with a request costs nothing up front), it can roll back consumed tokens (what speculative decoding's
verification needs), and it is a small self-contained wheel (no torch or compiler at run time); vLLM and SGLang
ship it as a backend.

The grammar's state is a function of the output tokens alone, so the tiers never exchange it: the prefill tier
samples the first token under the grammar's initial mask, and the decode tier builds the same grammar and
replays that token into it (Request.append_output_token) before decoding on.

Masks (vLLM's StructuredOutputManager.grammar_bitmask): each sampled row of a constrained request gets the
grammar's bitmask of allowed tokens after the tokens before that row; rows of a speculative step follow the
drafts, consumed tentatively and rolled back. A row after a draft the grammar refuses is left unmasked: the
target's token at the refused draft's row differs from it (the draft is masked out there), so the run ends
before that row is used.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import llguidance
import torch

from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import Request, StructuredOutputParams

# JSON is generated in json.dumps' default layout ({"a": 1, "b": [2, 3]}): with free whitespace a small model can
# loop on newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # characters a regex (Rust regex syntax, llguidance's) must see escaped


def grammar_for(params: StructuredOutputParams) -> str:
    """StructuredOutputParams -> an llguidance grammar (its serialized form). A choice is a regex alternation of
    the strings with every metacharacter escaped (so no choice text is read as syntax); a Lark alternation of
    literals would do the same but stops at 2,000 alternatives, and only once decoding reaches them."""
    if params.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, defaults=JSON_OPTIONS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        literals = ("".join("\\" + ch if ch in REGEX_META else ch for ch in choice) for choice in params.choice)
        return llguidance.LLMatcher.grammar_from_regex("|".join(literals))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


@functools.lru_cache(maxsize=256)
def check_grammar(params: StructuredOutputParams) -> str:
    """The grammar for params, checked without a tokenizer (a gateway's early validation). InvalidRequestError
    with llguidance's message when it does not compile. Cached: the same constraint (n completions, a gateway's
    second check, a schema many requests share) is compiled once per process."""
    try:
        grammar = grammar_for(params)
    except ValueError as e:
        raise InvalidRequestError(f"structured_output: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"structured_output: {error.splitlines()[0]}")
    return grammar


class GrammarMatcher:
    """One request's grammar state: an llguidance LLMatcher advanced over the tokens generated so far."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]):
        self.matcher, self.eos_token_ids = matcher, eos_token_ids

    def accept(self, token_id: int) -> bool:
        """Consume a generated token; True when the grammar is complete after it (nothing but EOS may follow).
        ValueError for a token the grammar refuses (a sampler that ignored the mask, or a bad first token)."""
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} violates the grammar: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of token_ids, from the first, the grammar allows next (the state does not change)."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0

    def fill_bitmask(self, bitmask: torch.Tensor, draft_token_ids: list[int]) -> None:
        """bitmask [len(draft_token_ids) + 1, ceil(vocab / 32)] int32, all ones on entry -> row i holds the
        tokens allowed after the first i drafts (bit t % 32 of word t // 32); rows after a refused draft or an
        EOS stay all ones. The state is as before on return."""
        # NOTE: a refused token puts an LLMatcher in its error state for good, and an EOS consumed does not roll
        # back cleanly: only the valid drafts before any EOS are consumed (a row after an EOS is never used)
        num_valid = self.num_valid(draft_token_ids)
        num_valid = next((i for i, t in enumerate(draft_token_ids[:num_valid]) if t in self.eos_token_ids), num_valid)
        for i in range(num_valid + 1):
            row = bitmask[i]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if i < num_valid:
                self.matcher.consume_token(draft_token_ids[i])
        if num_valid:
            self.matcher.rollback(num_valid)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, raw_logits: torch.Tensor) -> None:
    """In place on logits [num_rows, vocab] fp32 (processed: penalties, min_tokens): tokens whose bit is 0 in
    bitmask [num_rows, ceil(vocab / 32)] int32 get -inf. A row left with no token (min_tokens or stop_token_ids
    masked every token the grammar allows) takes raw_logits [num_rows, vocab] under the grammar's mask alone:
    the grammar wins."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    refused = ~((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]].to(logits.device)
    logits.masked_fill_(refused, float("-inf"))
    empty = logits.amax(-1) == float("-inf")
    if bool(empty.any()):
        logits[empty] = raw_logits[empty].masked_fill(refused[empty], float("-inf"))


def grammar_eos_ids(model_dir: str | Path, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens that end a grammar's text: the model's EOS ids, or, for a checkpoint whose config.json and
    generation_config.json name none, the tokenizer's eos_token (tokenizer_config.json, its id from tokenizer.json);
    () when neither has one."""
    if eos_token_ids:
        return eos_token_ids
    import json

    model_dir = Path(model_dir)
    eos = json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token") \
        if (model_dir / "tokenizer_config.json").exists() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])} | tokenizer["model"].get("vocab", {})
    return (ids[eos],) if eos in ids else ()


class StructuredOutputManager:
    """An engine's grammars: the llguidance tokenizer of the model (built from its tokenizer.json on the first
    constrained request, about a second), a matcher per constrained request, and each step's bitmasks.

    matcher() may run on any thread (AsyncEngine compiles grammars on a worker thread, off the engine's: llguidance
    releases the GIL while it compiles, so a large grammar does not stall the batch); the rest is the engine's."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self.eos_token_ids = eos_token_ids  # (grammar_eos_ids of them once the tokenizer is built)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self.eos_token_ids = grammar_eos_ids(self.model_dir, self.eos_token_ids)
                if not self.eos_token_ids:
                    raise InvalidRequestError("structured_output needs an end-of-sequence token, and this model names "
                                              "none (config.json, generation_config.json, tokenizer_config.json)")
                text = (Path(self.model_dir) / "tokenizer.json").read_text()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                         eos_token=list(self.eos_token_ids))  # fmt: skip
        return self._tokenizer

    def matcher(self, params: StructuredOutputParams) -> GrammarMatcher:
        """A new request's grammar in its initial state. InvalidRequestError when the grammar does not compile
        (a bad schema, regex or Lark text), with llguidance's message, or when it matches no text at all (its
        first mask is empty: a regex such as "a[^\\x00-\\U0010FFFF]" that no string satisfies)."""
        matcher = llguidance.LLMatcher(self.tokenizer, check_grammar(params), log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()  # (a dead start shows only here)
        if matcher.is_error():
            error = matcher.get_error().splitlines()[0]
            if "NoExtension" in error:
                error = "the constraint matches no text (no token can start it)"
            raise InvalidRequestError(f"structured_output: {error}")
        return GrammarMatcher(matcher, self.eos_token_ids)

    def grammar_bitmask(self, sampling: list[tuple[Request, list[int]]]) -> dict[str, torch.Tensor]:
        """The bitmasks of this step's constrained requests that sample, given as (request, its draft token ids
        this step): request id -> [num_drafts + 1, ceil(vocab / 32)] int32 (GrammarMatcher.fill_bitmask), for the
        rows ModelRunner.execute_model samples. Unconstrained requests are skipped."""
        masks = {}
        for request, drafts in sampling:
            if request.grammar is None:
                continue
            bitmask = torch.full((len(drafts) + 1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            request.grammar.fill_bitmask(bitmask, drafts)
            masks[request.request_id] = bitmask
        return masks


def replay_grammar(request: Request) -> None:
    """Bring a migrated request's grammar to its state after the output it arrived with (Request.output_token_ids:
    the tokens another engine generated before it failed), so the next token is constrained as it was there.
    InvalidRequestError when the grammar refuses a token or is complete before the last one (such a request had
    finished)."""
    for i, token_id in enumerate(request.output_token_ids):
        try:
            complete = request.grammar.accept(token_id)
        except ValueError as e:
            raise InvalidRequestError(f"output_token_ids[{i}]: {e}") from None
        if complete:
            raise InvalidRequestError(f"output_token_ids[{i}] completes the structured output: the request had "
                                      "finished there")  # fmt: skip
