"""An adapter's adapter_config.json (PEFT's LoraConfig), checked field by field into an AdapterConfig before any weight
is read: the fields that select what is not served, r and lora_alpha, rank_pattern / alpha_pattern and
target_modules. InvalidRequestError naming the field for anything else than what PEFT itself writes.

rank_pattern and alpha_pattern keys and a string target_modules are the user's regular expressions. Python's re
holds the GIL while it backtracks, so one pattern like "(.*.*)*X" would freeze the whole engine process for good:
they run with the regex module instead (the same syntax: each is first compiled by re, as PEFT does), whose
matches take a timeout and release the GIL, all of one read's matches within PATTERN_BUDGET_S together; a pattern
is at most MAX_PATTERN_CHARS long and its counted repeats ({m,n}, which regex expands when it compiles) multiply to
at most MAX_PATTERN_REPEATS.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

import regex

MAX_CONFIG_BYTES = 4 << 20
MAX_PATTERN_CHARS = 1000
MAX_PATTERNS = 4096  # keys of rank_pattern / alpha_pattern each (PEFT writes at most one per module)
MAX_PATTERN_REPEATS = 100
PATTERN_BUDGET_S = 1.0
# LoraConfig fields that select a variant with another forward (PEFT's is_lora_variant fields)
VARIANT_FIELDS = {"use_dora": "DoRA", "alora_invocation_tokens": "activated LoRA", "velora_config": "VeLoRA",
                  "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA", "arrow_config": "Arrow",
                  "kasa_config": "KaSA", "use_qalora": "QALoRA"}
# LoraConfig fields that train or change something besides the low-rank deltas of the linears
UNSUPPORTED_FIELDS = {"modules_to_save": "fully trained copies of modules", "trainable_token_indices":
                      "trained token embeddings", "target_parameters": "adapted parameters (MoE experts)",
                      "layer_replication": "replicated layers", "lora_bias": "a bias on lora_B"}
EMBEDDING_MODULES = ("embed_tokens", "lm_head")
_COUNTED_REPEAT = re.compile(r"\{(\d*),?(\d*)\}")

Refuse = Callable[[str], NoReturn]


class UserRegexes:
    """The user's regular expressions of one adapter read: compiled with checks, matched under one deadline."""

    def __init__(self, refuse: Refuse, budget_s: float | None = None):
        self.refuse, self.budget_s = refuse, PATTERN_BUDGET_S if budget_s is None else budget_s
        self.deadline = time.monotonic() + self.budget_s

    def compile(self, field: str, pattern, template: str = "{}") -> regex.Pattern:
        """pattern (a string from field) checked, then template.format(pattern) compiled by regex."""
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            self.refuse(f"{field}: a pattern must be a string of 1-{MAX_PATTERN_CHARS} characters, got "
                        f"{_short(pattern)}")
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            self.refuse(f"{field}: {_short(pattern)} is not a valid regular expression ({e})")
        repeats = math.prod(max(int(m or 0), int(n or 0)) or 1 for m, n in _COUNTED_REPEAT.findall(pattern))
        if repeats > MAX_PATTERN_REPEATS:
            self.refuse(f"{field}: the counted repeats of {_short(pattern)} multiply to more than "
                        f"{MAX_PATTERN_REPEATS}")
        try:
            return regex.compile(template.format(pattern))
        except (regex.error, OverflowError, RecursionError, MemoryError) as e:
            self.refuse(f"{field}: {_short(pattern)} is not a valid regular expression ({e})")

    def match(self, field: str, pattern: regex.Pattern, text: str, full: bool = False) -> bool:
        """Whether pattern matches the start (full: all) of text. Refuses once the read's budget is spent (regex
        counts a match's timeout in CPU seconds, so on a busy machine the wall time may be a few times more)."""
        timeout = self.deadline - time.monotonic()
        try:
            if timeout <= 0:
                raise TimeoutError
            found = (pattern.fullmatch if full else pattern.match)(text, timeout=timeout, concurrent=True)
        except TimeoutError:
            self.refuse(f"{field}: matching its patterns against the module names took over {self.budget_s} s "
                        f"(at {_short(pattern.pattern)}: a pattern that backtracks without end?)")
        return found is not None


@dataclass(frozen=True, eq=False)
class AdapterConfig:
    """The served part of a LoraConfig: r, lora_alpha (finite), use_rslora, and rank_pattern / alpha_pattern as
    (compiled `(.*\\.)?(key)$`, value) in the file's order."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[regex.Pattern, int], ...]
    alpha_pattern: tuple[tuple[regex.Pattern, float], ...]
    regexes: UserRegexes

    def rank(self, module: str) -> int:
        """module's r: rank_pattern's, else r."""
        return self._pattern_value("rank_pattern", self.rank_pattern, module, self.r)

    def scaling(self, module: str, r: int) -> float:
        """PEFT's LoraLayer scaling: lora_alpha / r, or / sqrt(r) with use_rslora (alpha_pattern's alpha first)."""
        alpha = self._pattern_value("alpha_pattern", self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def _pattern_value(self, field: str, patterns, module: str, default):
        """PEFT's get_pattern_key: the value of the first key k with `(.*\\.)?(k)$` matching module, else default."""
        for pattern, value in patterns:
            if self.regexes.match(field, pattern, module):
                return value
        return default


def parse_adapter_config(data: bytes, refuse: Refuse) -> AdapterConfig:
    """adapter_config.json's bytes -> AdapterConfig. InvalidRequestError (through refuse) naming the field."""
    if len(data) > MAX_CONFIG_BYTES:
        refuse(f"adapter_config.json is over {MAX_CONFIG_BYTES >> 20} MiB")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        refuse("adapter_config.json is not valid JSON")
    if not isinstance(config, dict):
        refuse("adapter_config.json is not a JSON object")
    if config.get("peft_type") != "LORA":
        refuse(f"peft_type {_short(config.get('peft_type'))}: only LORA adapters are served")
    for field, what in VARIANT_FIELDS.items():
        if config.get(field):
            refuse(f"{field} ({what}) is not supported: plain LoRA only")
    if config.get("init_lora_weights") == "mica":
        refuse("init_lora_weights 'mica' (MiCA, a LoRA variant) is not supported: plain LoRA only")
    for field, what in UNSUPPORTED_FIELDS.items():
        if config.get(field):
            refuse(f"{field} ({what}) is not supported: only the low-rank deltas of the linears")
    if config.get("bias", "none") != "none":
        refuse(f"bias {_short(config['bias'])} (trained biases of the base model) is not supported: it must be "
               "'none'")
    r, alpha, rslora = config.get("r"), config.get("lora_alpha"), config.get("use_rslora") or False
    if not _is_int(r) or r <= 0:
        refuse(f"r must be a positive integer, got {_short(r)}")
    if not _is_finite(alpha):
        refuse(f"lora_alpha must be a finite number, got {_short(alpha)}")
    if not isinstance(rslora, bool):
        refuse(f"use_rslora must be true or false, got {_short(rslora)}")
    regexes = UserRegexes(refuse)
    _check_target_modules(config.get("target_modules"), regexes, refuse)
    ranks = _patterns(config, "rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer", regexes, refuse)
    alphas = _patterns(config, "alpha_pattern", _is_finite, "a finite number", regexes, refuse)
    return AdapterConfig(r, float(alpha), rslora, ranks, tuple((p, float(a)) for p, a in alphas), regexes)


def _check_target_modules(targets, regexes: UserRegexes, refuse: Refuse) -> None:
    """Refuses a target_modules that is not a regex or a list of names, or that names the embeddings or lm_head
    (the weights file says which modules are adapted: that is all target_modules is read for)."""
    if isinstance(targets, str):
        pattern = regexes.compile("target_modules", targets)
        named = [m for m in EMBEDDING_MODULES if regexes.match("target_modules", pattern, m, full=True)
                 or regexes.match("target_modules", pattern, f"model.{m}", full=True)]  # fmt: skip
    elif targets is None or isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        named = [m for m in EMBEDDING_MODULES for t in targets or () if t == m or t.endswith(f".{m}")]
    else:
        refuse(f"target_modules must be a regex or a list of module names, got {_short(targets)}")
    if named:
        refuse(f"target_modules names {named[0]}: adapters of the embeddings or the LM head are not supported")


def _patterns(config: dict, field: str, valid, what: str, regexes: UserRegexes, refuse: Refuse) -> tuple:
    patterns = config.get(field) or {}
    if not isinstance(patterns, dict) or len(patterns) > MAX_PATTERNS:
        refuse(f"{field} must be an object of at most {MAX_PATTERNS} module patterns, got {_short(patterns)}")
    for key, value in patterns.items():
        if not valid(value):
            refuse(f"{field}: the value for {_short(key)} must be {what}, got {_short(value)}")
    return tuple((regexes.compile(field, key, r"(.*\.)?({})$"), value) for key, value in patterns.items())


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # (an int beyond float's range)
        return False


def _short(value) -> str:
    """repr of a user's value, cut to 80 characters (a message must not echo a megabyte)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
