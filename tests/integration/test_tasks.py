"""The task suite through the engine: batched greedy outputs of the default fp32 model equal HF transformers'
greedy outputs for the same prompts, and a report diffed against itself changes nothing."""
import pytest

from tandem.tools.tasks import CATEGORIES, diff_report, evaluate_tasks, load_tasks, prompt_token_ids

NUM_TOKENS = 48


@pytest.mark.heavy  # (.ci/run's heavy pass: 12 s; the tasks' checks and report format have unit tests)
def test_engine_answers_equal_hf_greedy_and_a_report_does_not_differ_from_itself(model_config, tokenizer, hf_greedy):
    tasks = load_tasks(limit_per_category=3)
    assert len(tasks) == 12
    report = evaluate_tasks(model_config, tasks, max_tokens=NUM_TOKENS)
    expected = [tokenizer.decode(hf_greedy(prompt_token_ids(tokenizer, t), NUM_TOKENS), skip_special_tokens=True)
                for t in tasks]
    assert [r.output for r in report.results] == expected
    assert [r.id for r in report.results] == [t.id for t in tasks]
    assert set(report.category_accuracy) == set(CATEGORIES) and report.output_tokens_per_s > 0
    diff = diff_report(report, report)
    assert (diff["num_items"], diff["num_changed"], diff["correct_to_wrong"], diff["wrong_to_correct"]) == (12, 0, 0, 0)
