"""tools/tasks.py: every check kind on hand-written outputs, code run in a guarded subprocess, completion cutting,
the shipped task file and malformed ones, and diff reports."""
import json
from collections import Counter

import pytest

from tests.prompts import prompt_token_ids as gateway_prompt_token_ids
from tandem.tools.tasks import (CATEGORIES, TASKS_FILE, Task, TaskReport, TaskResult, cut_completion, diff_report, load_tasks,
                         prompt_token_ids, run_code, score)

FAST_S = 2.0  # subprocess timeout in these tests


def make_task(check, category="factual", prompt="Question?", chat=True) -> Task:
    return Task("t-001", category, prompt, chat, check)


def make_code_task(tests, prompt='def f(x):\n    """Return x plus one."""\n    return') -> Task:
    return make_task({"kind": "python", "entry": "f", "tests": tests}, category="code", prompt=prompt, chat=False)


@pytest.mark.parametrize("output, answer, expected", [
    ("42", 42, True), ("42", 43, False), ("The answer is 42.", 42, True), ("17 + 25 = 42", 42, True),
    ("17 + 25 = 32", 42, False), ("-3", -3, True), ("3", -3, False), ("4 - 7 = -3", -3, True), ("1,234", 1234, True),
    ("It is 12,345,678 in total", 12345678, True), ("42.0", 42, True), ("42.5", 42, False), ("no number", 0, False),
    (" 12\n\nQuestion: What is 2 + 2?\nAnswer: 4", 12, True), (" 12\n\nQuestion: What is 2 + 2?\nAnswer: 4", 4, False),
    ("\n\n7 is right", 7, True), ("1, 2", 2, True), ("", 0, False),
])
def test_number_is_the_last_number_of_the_first_line(output, answer, expected):
    assert score(make_task({"kind": "number", "answer": answer}, category="arithmetic"), output) is expected


@pytest.mark.parametrize("output, expected", [
    ("The capital of France is Paris.", True), ("PARIS", True), ("paris, of course", True),
    ("The Parisian cafes", False), ("Lyon", False), ("It is in Île-de-France: Paris!", True), ("", False),
])
def test_contains_is_case_insensitive_on_word_boundaries(output, expected):
    assert score(make_task({"kind": "contains", "any": ["Paris"]}), output) is expected


def test_contains_accepts_any_listed_string_and_phrases_and_not_digits_of_decimals():
    eight = make_task({"kind": "contains", "any": ["8", "eight"]})
    assert score(eight, "A spider has eight legs.") and score(eight, "8 legs") and not score(eight, "18 legs")
    assert not score(eight, "about 1.8 legs") and not score(eight, "8.5 legs") and score(eight, "legs: 8.")
    whale = make_task({"kind": "contains", "any": ["blue whale"]})
    assert score(whale, "The Blue Whale is the largest.") and not score(whale, "a blue car and a whale")


def test_regex_searches_the_stripped_output_or_matches_it_whole():
    assert score(make_task({"kind": "regex", "pattern": r"^yes\b", "flags": "i"}), "  Yes, it is.")
    assert not score(make_task({"kind": "regex", "pattern": r"^yes\b"}), "Yes, it is.")  # case-sensitive
    assert not score(make_task({"kind": "regex", "pattern": r"^yes\b", "flags": "i"}), "Well, yes.")
    full = make_task({"kind": "regex", "pattern": r"(?:apple\s*){3}", "flags": "i", "full": True})
    assert score(full, "apple apple Apple\n") and not score(full, "apple apple apple apple")
    assert not score(full, "Sure: apple apple apple")
    period = make_task({"kind": "regex", "pattern": r"[^.!?\n]\.$"})
    assert score(period, "A dog is an animal.") and not score(period, "A dog is") and not score(period, "Wait...")


@pytest.mark.parametrize("output, expected", [
    ('{"color": "green"}', True), ('```json\n{\n  "color": "green"\n}\n```', True), ('Sure! {"color": 1} ok', True),
    ('{"name": "green"}', False), ('{"color": green}', False), ('["color"]', False), ("green", False), ("", False),
])
def test_json_key_needs_a_json_object_with_the_key(output, expected):
    assert score(make_task({"kind": "json_key", "key": "color"}, category="instruction"), output) is expected


def test_word_count_counts_whitespace_separated_words():
    one = make_task({"kind": "word_count", "min": 1, "max": 1}, category="instruction")
    assert score(one, "Cow.") and score(one, "  cow\n") and not score(one, "A cow.") and not score(one, "")
    assert score(make_task({"kind": "word_count", "min": 1, "max": 5}), "The sea is blue.")


def test_code_passes_when_every_assert_holds():
    task = make_code_task(["assert f(1) == 2", "assert f(-1) == 0"])
    assert score(task, " x + 1\n\nprint(f(3))\n", timeout_s=FAST_S)
    assert not score(task, " x + 2\n", timeout_s=FAST_S)
    assert not score(task, " x +\n", timeout_s=FAST_S)  # syntax error
    assert not score(task, "", timeout_s=FAST_S)  # returns None


def test_code_that_loops_forever_times_out():
    assert not score(make_code_task(["assert f(1) == 2"]), " f(x)\n", timeout_s=FAST_S)  # RecursionError: fails
    assert not run_code("def f(x):\n    while True:\n        pass\n", ["assert f(1) == 2"], timeout_s=1.0)


def test_code_cannot_reach_the_system(tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    marker = tmp_path / "pwned"
    attempts = [f"import os\n    os.system('touch {marker}')\n    return x + 1",
                f"import shutil\n    shutil.rmtree({str(keep)!r})\n    return x + 1",
                "import subprocess\n    subprocess.run(['true'])\n    return x + 1",
                "import os\n    os.fork()\n    return x + 1"]
    for body in attempts:
        prompt = 'def f(x):\n    """Return x plus one."""\n    '
        assert not score(make_code_task(["assert f(1) == 2"], prompt=prompt), body, timeout_s=FAST_S), body
    assert keep.is_dir() and not marker.exists()


def test_code_cannot_fake_a_pass_or_flood_the_output(tmp_path):
    """The breaker's cases: the pass marker is not in the program's text, posix's functions are guarded like
    os's, and an endless print dies at the file-size limit instead of filling the caller's memory."""
    read_own_source = ("import re, sys\ndef f(x):\n    print(*re.findall(r'[0-9a-f]{16}', open(__file__).read()))\n"
                       "    sys.exit(0)\n")
    assert not run_code(read_own_source, ["assert f(1) == 2"], FAST_S)
    late = tmp_path / "late"
    assert not run_code(f"import posix\nposix.system('touch {late}')\n", [], FAST_S)
    assert not run_code("import posix\nposix._exit(0)\n", ["assert False"], FAST_S)
    assert not run_code("import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n", [], timeout_s=20.0)
    assert not late.exists()
    assert not run_code("x = '\ud800'\n", [], FAST_S)  # a lone surrogate: False, no exception


def test_code_that_exhausts_memory_or_exits_early_fails():
    assert not run_code("def f(x):\n    b = bytearray(1 << 34)\n    return x + 1\n", ["assert f(1) == 2"], FAST_S)
    assert not run_code("def f(x):\n    return [0] * (1 << 31)\n", ["assert f(1)"], FAST_S)
    assert not run_code("import sys\ndef f(x):\n    sys.exit(0)\n", ["assert f(1) == 2"], FAST_S)
    assert not run_code("def f(x):\n    raise SystemExit(0)\n", ["assert f(1) == 2"], FAST_S)
    assert run_code("def f(x):\n    return x + 1\n", ["assert f(1) == 2"], FAST_S)


def test_cut_completion_ends_the_body_at_a_top_level_line_or_a_stop():
    prompt = 'def f(x):\n    """Doc."""\n    return'
    assert cut_completion(prompt, " x + 1\n\n# Example usage:\nprint(f(2))") == " x + 1\n"
    assert cut_completion(prompt, " x + 1\nclass A:\n    pass") == " x + 1"
    assert cut_completion(prompt, " x + 1\n```\n\nThis function ...") == " x + 1"
    assert cut_completion(prompt, " x + 1\nif __name__ == '__main__':\n    f(1)") == " x + 1"
    body = " x % 2 == 0:\n            total += x\n\n    return total"
    assert cut_completion("    for x in xs:\n        if", body + "\nprint(1)") == body
    assert cut_completion("def f(x):\n", "y = 1\n    return x") == ""  # a new line that is not indented
    assert cut_completion("def f(x):\n", "    return x\nf(1)") == "    return x"
    assert cut_completion("def f(x):\n    return", "") == ""


def test_shipped_tasks_load_with_valid_checks_and_unique_ids():
    tasks = load_tasks()
    counts = Counter(t.category for t in tasks)
    assert counts == {"arithmetic": 100, "factual": 80, "instruction": 70, "code": 50}
    assert len({t.id for t in tasks}) == len(tasks) == 300
    assert not any(t.chat for t in tasks if t.category == "code") and sum(not t.chat for t in tasks) == 65
    assert {t.check["kind"] for t in tasks} == {"number", "contains", "regex", "json_key", "word_count", "python"}
    assert [t.id for t in load_tasks(categories=["code"], limit_per_category=3)] == ["code-001", "code-002", "code-003"]
    assert Counter(t.category for t in load_tasks(limit_per_category=2)) == {c: 2 for c in CATEGORIES}
    with pytest.raises(ValueError, match="unknown categories"):
        load_tasks(categories=["poetry"])


@pytest.mark.heavy
def test_every_code_item_passes_with_its_solution_and_fails_with_an_empty_body():
    """A check of the data (every code item's tests run against its solution and an empty body: 11 s): .ci/run's
    heavy pass."""
    code = [t for t in load_tasks() if t.category == "code"]
    assert all(t.solution for t in code)
    assert [t.id for t in code if not score(t, t.solution)] == []
    assert [t.id for t in code if score(t, "")] == []


GOOD = {"id": "x-1", "category": "factual", "prompt": "Q?", "chat": True, "check": {"kind": "contains", "any": ["a"]}}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "Expecting"),
    (GOOD | {"check": {"kind": "exact", "answer": "a"}}, "check kind 'exact'"),
    (GOOD | {"check": {"kind": "regex", "pattern": "("}}, "missing"),
    (GOOD | {"check": {"kind": "regex", "pattern": "a", "flags": "x"}}, "invalid regex"),
    (GOOD | {"check": {"kind": "number", "answer": "42"}}, "invalid number"),
    (GOOD | {"check": {"kind": "number", "answer": 4, "pick": "last"}}, "a number check has fields"),
    (GOOD | {"check": {"kind": "contains", "any": []}}, "invalid contains"),
    (GOOD | {"check": {"kind": "word_count", "min": 3, "max": 1}}, "invalid word_count"),
    (GOOD | {"check": {"kind": "python", "entry": "f", "tests": ["assert f()"]}}, "only they"),
    (GOOD | {"category": "code", "chat": False, "check": {"kind": "python", "entry": "g", "tests": ["assert g()"]},
             "prompt": "def f():\n    return"}, "entry function 'g'"),
    (GOOD | {"category": "poetry"}, "category 'poetry'"),
    (GOOD | {"chat": "yes"}, "chat a boolean"),
    (GOOD | {"extra": 1}, "unknown fields"),
    ({k: v for k, v in GOOD.items() if k != "prompt"}, "prompt"),
    (GOOD, "duplicate id 'x-1'"),
    ([1, 2], "JSON object"),
])
def test_malformed_items_raise_value_error_naming_the_line(tmp_path, bad, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(ValueError, match=rf"tasks.jsonl:3: .*{message}"):
        load_tasks(path)


def test_prompt_token_ids_are_the_gateways(tokenizer):
    chat, raw = make_task({"kind": "contains", "any": ["a"]}), make_code_task(["assert f(1) == 2"])
    assert prompt_token_ids(tokenizer, chat) == gateway_prompt_token_ids(tokenizer, "chat", chat.prompt)
    assert prompt_token_ids(tokenizer, raw) == tokenizer(raw.prompt, add_special_tokens=False).input_ids


def make_report(*items) -> TaskReport:
    """items: (id, output, correct), all in category "factual"."""
    return TaskReport([TaskResult(i, "factual", f"Prompt of {i} " + "x" * 100, out, ok) for i, out, ok in items])


def test_diff_report_counts_changed_answers_and_flips():
    ref = make_report(("a", "Paris", True), ("b", "Rome", False), ("c", "Oslo", True), ("d", "x", False))
    other = make_report(("a", "Paris", True), ("b", "Madrid", True), ("c", "Lyon", False), ("d", "y", False))
    diff = diff_report(ref, other, max_examples=2)
    assert (diff["num_items"], diff["num_changed"], diff["correct_to_wrong"], diff["wrong_to_correct"]) == (4, 3, 1, 1)
    assert [e["id"] for e in diff["examples"]] == ["b", "c"]
    assert diff["examples"][0]["reference"] == "Rome" and diff["examples"][0]["output"] == "Madrid"
    assert len(diff["examples"][0]["prompt"]) == 80 and diff["examples"][0]["prompt"].endswith("...")
    assert diff_report(ref, ref)["num_changed"] == 0 and diff_report(ref, ref)["examples"] == []
    with pytest.raises(ValueError, match="share no item"):
        diff_report(ref, make_report(("z", "", False)))


def test_report_accuracy_per_category_and_overall():
    report = TaskReport([TaskResult("a", "code", "p", "o", True), TaskResult("b", "code", "p", "o", False),
                         TaskResult("c", "factual", "p", "o", True)])
    assert report.accuracy == pytest.approx(2 / 3)
    assert report.category_accuracy == {"code": 0.5, "factual": 1.0}
    assert TaskReport([]).accuracy == 0.0


def test_tasks_file_is_package_data_next_to_the_other_evaluation_data():
    assert TASKS_FILE.name == "quant_tasks.jsonl" and TASKS_FILE.exists()
