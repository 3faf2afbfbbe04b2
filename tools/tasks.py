"""Task-level evaluation of a model (float or quantized): a few hundred short items with checkable answers
(tools/data/quant_tasks.jsonl: arithmetic, factual questions, instruction following, code completion), generated
greedily by the project's engine and scored right or wrong; plus a report of how many answers a quantized format
changes against fp32.

Each item's "check" says how its answer is scored (score()):
    {"kind": "number", "answer": int}        the last number on the output's first non-empty line ("-3",
                                             "1,234", "42.0") equals answer: small models restate the question
                                             ("17 + 25 = 42") or run on after the answer (" 42\n\nQuestion: ...")
    {"kind": "contains", "any": [str, ...]}  one of the strings occurs (case-insensitive, on word boundaries)
    {"kind": "regex", "pattern": str, "flags": "i", "full": bool}   re.search (re.fullmatch if full) on the
                                             stripped output; flags and full are optional
    {"kind": "json_key", "key": str}         the first {...} in the output parses as a JSON object with that key
    {"kind": "word_count", "min": int, "max": int}   number of whitespace-separated words in the output
    {"kind": "python", "entry": str, "tests": [str, ...]}   code: prompt + completion, then the asserts, run in
                                             a subprocess (run_code)
Code items may carry a "solution" (a hand-written body) that passes their tests.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.tools.evaluation import DATA_DIR

TASKS_FILE = DATA_DIR / "quant_tasks.jsonl"
CATEGORIES = ("arithmetic", "factual", "instruction", "code")
CHECK_FIELDS = {  # kind -> (required fields, optional fields)
    "number": ({"answer"}, set()),
    "contains": ({"any"}, set()),
    "regex": ({"pattern"}, {"flags", "full"}),
    "json_key": ({"key"}, set()),
    "word_count": ({"min", "max"}, set()),
    "python": ({"entry", "tests"}, set()),
}
CODE_STOPS = ("\nclass ", "\nif __name__", "\ndef ", "\nprint(", "\n```")
CODE_TIMEOUT_S = 10.0
CODE_MEMORY_BYTES = 1 << 30  # RLIMIT_AS of the subprocess
CODE_CPU_S = 5  # RLIMIT_CPU
CODE_FILE_BYTES = 1 << 20  # RLIMIT_FSIZE (stdout included)
CODE_MAX_PROCESSES = 64  # RLIMIT_NPROC
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")


@dataclass(frozen=True)
class Task:
    id: str
    category: str  # one of CATEGORIES
    prompt: str
    chat: bool  # True: the model's chat template around prompt; False: prompt as raw text
    check: dict
    solution: str | None = None  # code items: a reference completion that passes check["tests"]


def load_tasks(path: str | Path = TASKS_FILE, categories: list[str] | None = None,
               limit_per_category: int | None = None) -> list[Task]:
    """Tasks of a JSONL file in file order, optionally only some categories and the first N of each.

    Raises ValueError naming the line of a malformed item (bad JSON, missing or unknown field, unknown category
    or check kind, an invalid regex, a duplicate id) or an unknown category asked for."""
    if categories is not None and not set(categories) <= set(CATEGORIES):
        raise ValueError(f"unknown categories {sorted(set(categories) - set(CATEGORIES))}; known: {CATEGORIES}")
    tasks, seen, counts = [], set(), {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = _parse_task(json.loads(line))
        except (ValueError, TypeError, KeyError, re.error) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
        if task.id in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {task.id!r}")
        seen.add(task.id)
        if categories is not None and task.category not in categories:
            continue
        counts[task.category] = counts.get(task.category, 0) + 1
        if limit_per_category is None or counts[task.category] <= limit_per_category:
            tasks.append(task)
    return tasks


def _parse_task(item: dict) -> Task:
    if not isinstance(item, dict):
        raise ValueError("an item must be a JSON object")
    extra = set(item) - {"id", "category", "prompt", "chat", "check", "solution"}
    if extra:
        raise ValueError(f"unknown fields {sorted(extra)}")
    task = Task(id=item["id"], category=item["category"], prompt=item["prompt"], chat=item["chat"],
                check=item["check"], solution=item.get("solution"))
    if not (isinstance(task.id, str) and isinstance(task.prompt, str) and task.prompt and isinstance(task.chat, bool)):
        raise ValueError("id and prompt must be non-empty strings, chat a boolean")
    if task.category not in CATEGORIES:
        raise ValueError(f"category {task.category!r} is not one of {CATEGORIES}")
    _validate_check(task.check)
    if (task.check["kind"] == "python") != (task.category == "code"):
        raise ValueError("code items, and only they, use a python check")
    if task.category == "code" and f"def {task.check['entry']}(" not in task.prompt:
        raise ValueError(f"the prompt does not define the entry function {task.check['entry']!r}")
    return task


def _validate_check(check: dict) -> None:
    kind = check.get("kind") if isinstance(check, dict) else None
    if kind not in CHECK_FIELDS:
        raise ValueError(f"check kind {kind!r} is not one of {sorted(CHECK_FIELDS)}")
    required, optional = CHECK_FIELDS[kind]
    if not required <= set(check) or set(check) - required - optional - {"kind"}:
        raise ValueError(f"a {kind} check has fields {sorted(required)} (optional: {sorted(optional)})")
    if kind == "number":
        ok = type(check["answer"]) is int
    elif kind == "contains":
        ok = _non_empty_strings(check["any"])
    elif kind == "regex":
        ok = isinstance(check["pattern"], str) and check.get("flags", "") in ("", "i")
        ok = ok and isinstance(check.get("full", False), bool) and re.compile(check["pattern"]) is not None
    elif kind == "json_key":
        ok = isinstance(check["key"], str)
    elif kind == "word_count":
        ok = type(check["min"]) is int and type(check["max"]) is int and 0 <= check["min"] <= check["max"]
    else:
        ok = isinstance(check["entry"], str) and check["entry"].isidentifier() and _non_empty_strings(check["tests"])
    if not ok:
        raise ValueError(f"invalid {kind} check {check}")


def _non_empty_strings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(s, str) and s for s in value)


def prompt_token_ids(tokenizer, task: Task) -> list[int]:
    """Token ids as the gateway builds them: the chat template (with the generation prompt) for chat items,
    the raw text without special tokens otherwise."""
    if task.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}],
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer(task.prompt, add_special_tokens=False).input_ids


def score(task: Task, output_text: str, timeout_s: float = CODE_TIMEOUT_S) -> bool:
    """Whether output_text answers task (see the module docstring for each check kind). Code runs in a
    subprocess (run_code) for at most timeout_s seconds; anything but every assert passing is False."""
    check, text = task.check, output_text.strip()
    kind = check["kind"]
    if kind == "number":
        numbers = _NUMBER.findall(text.split("\n", 1)[0])  # text is stripped: its first line is not empty
        return bool(numbers) and float(numbers[-1].replace(",", "")) == check["answer"]
    if kind == "contains":
        # word boundaries; a digit of a decimal ("18.0") is not a word of its own
        return any(re.search(rf"(?<!\w)(?<!\d\.){re.escape(s)}(?!\w)(?!\.\d)", text, re.IGNORECASE)
                   for s in check["any"])
    if kind == "regex":
        flags = re.IGNORECASE if check.get("flags") == "i" else 0
        match = re.fullmatch if check.get("full") else re.search
        return match(check["pattern"], text, flags) is not None
    if kind == "json_key":
        start = text.find("{")
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:]) if start >= 0 else (None, 0)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and check["key"] in value
    if kind == "word_count":
        return check["min"] <= len(text.split()) <= check["max"]
    program = task.prompt + cut_completion(task.prompt, output_text)
    return run_code(program, check["tests"], timeout_s)


def cut_completion(prompt: str, completion: str) -> str:
    """The completion up to where the function body ends: the first of CODE_STOPS or the first non-empty line
    that is not indented (a new top-level statement). A first line that continues the prompt's last line (prompt
    not ending in a newline) is kept whatever its indentation."""
    for stop in CODE_STOPS:
        completion = completion.split(stop, 1)[0]
    lines = completion.split("\n")
    kept = []
    for i, line in enumerate(lines):
        continues_prompt = i == 0 and not prompt.endswith("\n")
        if not continues_prompt and line.strip() and not line[0].isspace():
            break
        kept.append(line)
    return "\n".join(kept)


# Run before the program: disables the obvious ways to touch the system (HumanEval's reliability guard), in os
# and in posix (os's functions are posix's), then reads the pass marker from stdin into a closure.
# NOTE: an accident guard, not a sandbox: code written to escape (frame inspection, ctypes, sockets, a child in a
# session of its own) can. The rlimits, the timeout, the capped output and the empty temp dir bound accidents
# (an endless loop or print, a memory blow-up, a stray child); run the suite on models whose code you would run.
_GUARD = """import builtins, os, posix, shutil, subprocess, sys
for _module in (os, posix):
    for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "rmdir",
                  "removedirs", "rename", "replace", "truncate", "chmod", "chown", "putenv", "execv", "execve",
                  "spawnv", "posix_spawn", "posix_spawnp", "_exit", "setsid"):
        if hasattr(_module, _name):
            setattr(_module, _name, None)
shutil.rmtree = shutil.move = subprocess.Popen = subprocess.run = None
_tandem_pass = (lambda marker: lambda: print(marker, flush=True))(sys.stdin.readline().strip())
del builtins, os, posix, shutil, subprocess, sys, _module, _name
"""
OUTPUT_TAIL_BYTES = 256  # the end of stdout that is read back (the marker sits there)


def run_code(program: str, tests: list[str], timeout_s: float = CODE_TIMEOUT_S) -> bool:
    """True when program followed by the asserts in tests runs to the end in a fresh interpreter.

    The interpreter (sys.executable -I -S) runs in a new empty temp dir with a minimal environment, its own
    session (killed as a group when it ends or times out), rlimits of CODE_MEMORY_BYTES address space, CODE_CPU_S
    CPU seconds, CODE_FILE_BYTES per written file (stdout goes to a file, so an endless print dies there), after
    _GUARD. Success needs exit status 0 and a random marker, given on stdin (not in the program's text), printed
    after the last assert, so a program that exits early does not pass. Never raises for bad code."""
    marker = secrets.token_hex(8)
    source = "\n".join([_GUARD, program, "", *tests, "_tandem_pass()", ""])
    with tempfile.TemporaryDirectory(prefix="tandem-task-") as tmp:
        try:
            (Path(tmp) / "program.py").write_text(source, encoding="utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not a program Python could read either
            return False
        with open(Path(tmp) / "stdout", "w+b") as stdout:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "program.py"], cwd=tmp, stdin=subprocess.PIPE,
                                    stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True,
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, preexec_fn=_limit_resources)
            try:
                proc.communicate(f"{marker}\n".encode(), timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: children it left behind too
                proc.wait()
            stdout.seek(max(stdout.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES, 0))
            tail = stdout.read()
    return not timed_out and proc.returncode == 0 and tail.decode(errors="replace").strip().endswith(marker)


def _limit_resources() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CODE_MEMORY_BYTES, CODE_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CODE_CPU_S, CODE_CPU_S))
    resource.setrlimit(resource.RLIMIT_FSIZE, (CODE_FILE_BYTES, CODE_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (CODE_MAX_PROCESSES, CODE_MAX_PROCESSES))  # (root is exempt)


def generate(model_config, tasks: list[Task], max_tokens: int = 64, threads: int = 1, device: str = "cpu",
             max_num_seqs: int = 16) -> tuple[list[str], float]:
    """Greedy outputs of tasks (temperature 0, ending at EOS or max_tokens), batched in one in-process engine.

    Returns (one decoded text per task, special tokens skipped; output tokens per second over the whole run,
    prefill included). threads: torch and C++ kernel threads while generating (restored after). A request the
    engine fails (e.g. non-finite logits) keeps the tokens it had. Raises ValueError when a prompt does not fit
    the model's context."""
    import torch
    from transformers import AutoTokenizer

    from tandem.kernels import cpu_ext
    from tandem.shared.config import CacheConfig, SchedulerConfig
    from tandem.shared.engine import LLMEngine
    from tandem.shared.request import Request, SamplingParams

    if not tasks:
        return [], 0.0
    tokenizer = AutoTokenizer.from_pretrained(model_config.path)
    prompts = [prompt_token_ids(tokenizer, task) for task in tasks]
    block_size = 16
    longest = max(len(ids) for ids in prompts) + max_tokens
    if longest > model_config.max_model_len:
        raise ValueError(f"a prompt of {longest - max_tokens} tokens + {max_tokens} do not fit the context")
    num_blocks = max_num_seqs * -(-longest // block_size) + 16
    old_threads, old_kernel_threads = torch.get_num_threads(), cpu_ext.num_threads()
    torch.set_num_threads(1)  # engine built with one torch thread (shared/async_engine.py's NOTE)
    try:
        engine = LLMEngine(model_config, CacheConfig(block_size, num_blocks), SchedulerConfig(512, max_num_seqs),
                           device)
        torch.set_num_threads(threads)
        cpu_ext.set_num_threads(threads)
        outputs: list[list[int]] = [[] for _ in tasks]
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(Request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[int(out.request_id)] += out.new_token_ids
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(old_threads)
        cpu_ext.set_num_threads(old_kernel_threads)
    num_tokens = sum(len(ids) for ids in outputs)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    return texts, num_tokens / seconds if seconds > 0 else 0.0


@dataclass(frozen=True)
class TaskResult:
    id: str
    category: str
    prompt: str
    output: str
    correct: bool


@dataclass
class TaskReport:
    """Scored outputs of one model: per item, per category and overall accuracy (fractions in [0, 1])."""

    results: list[TaskResult]
    output_tokens_per_s: float = 0.0  # generation throughput of the run, prefill included

    @property
    def accuracy(self) -> float:
        return sum(r.correct for r in self.results) / len(self.results) if self.results else 0.0

    @property
    def category_accuracy(self) -> dict[str, float]:
        by_category: dict[str, list[bool]] = {}
        for r in self.results:
            by_category.setdefault(r.category, []).append(r.correct)
        return {c: sum(v) / len(v) for c, v in by_category.items()}


def evaluate_tasks(model_config, tasks: list[Task], max_tokens: int = 64, threads: int = 1,
                   device: str = "cpu") -> TaskReport:
    """Generate (greedy) and score every task; see generate() and score() for units and errors."""
    outputs, tokens_per_s = generate(model_config, tasks, max_tokens, threads, device)
    results = [TaskResult(t.id, t.category, t.prompt, out, score(t, out)) for t, out in zip(tasks, outputs)]
    return TaskReport(results, tokens_per_s)


def diff_report(reference: TaskReport, other: TaskReport, max_examples: int = 5) -> dict:
    """How other's answers differ from reference's on the items both scored.

    Returns {"num_items", "num_changed" (output text differs), "correct_to_wrong", "wrong_to_correct",
    "examples": [{"id", "prompt" (at most 80 chars), "reference" (reference's answer), "reference_correct",
    "output", "output_correct"}, ...] (first max_examples changed)}.
    Raises ValueError when the reports share no item."""
    theirs = {r.id: r for r in other.results}
    pairs = [(r, theirs[r.id]) for r in reference.results if r.id in theirs]
    if not pairs:
        raise ValueError("the reports share no item")
    changed = [(r, o) for r, o in pairs if r.output != o.output]
    return {
        "num_items": len(pairs),
        "num_changed": len(changed),
        "correct_to_wrong": sum(r.correct and not o.correct for r, o in pairs),
        "wrong_to_correct": sum(o.correct and not r.correct for r, o in pairs),
        "examples": [{"id": r.id, "prompt": _shorten(r.prompt), "reference": r.output,
                      "reference_correct": r.correct, "output": o.output, "output_correct": o.correct}
                     for r, o in changed[:max_examples]],
    }


def _shorten(text: str, width: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
