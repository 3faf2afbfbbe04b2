"""`tandem bench` pieces without a server: the metrics math on hand-made timings (each expected value worked out
by hand from the definitions), arrival times, the load loops on a toy backend, and the workloads' determinism and
length distributions."""
import asyncio
import math

import pytest
from tqdm import tqdm

from tandem.benchmarks.bench.backends.base import RequestResult
from tandem.benchmarks.bench.metrics import compute_metrics, meets_slos, parse_slo
from tandem.benchmarks.bench.report import ratios_to_baseline, token_agreement
from tandem.benchmarks.bench.runner import Load, RunResult, arrival_times_s, run_static, run_streaming
from tandem.benchmarks.bench.workloads import BenchRequest, build_requests


def make_result(index=0, ttft=0.1, gaps=(0.05, 0.1, 0.05), tail=0.0, prompt_len=10, error=None, start=0.0):
    """A request sent at `start` s whose first token came after ttft s, the next ones `gaps` s apart, complete
    `tail` s after the last token."""
    times = [start + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestResult(index, prompt_len, start_s=start, token_times_s=times,
                         output_token_ids=list(range(len(times))), end_s=times[-1] + tail, error=error)  # fmt: skip


def test_request_timings_follow_their_definitions():
    r = make_result(ttft=0.1, gaps=(0.05, 0.1, 0.05), tail=0.02)  # tokens at 0.10 0.15 0.25 0.30, end 0.32
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.32)
    assert r.tpot_s == pytest.approx((0.32 - 0.1) / 3)  # (E2E - TTFT) / (4 tokens - 1)
    assert r.itl_s == pytest.approx([0.05, 0.1, 0.05])
    one = make_result(gaps=())
    assert one.tpot_s is None and one.itl_s == []


def test_metrics_of_a_run():
    results = [
        make_result(0, ttft=0.1, gaps=(0.05, 0.05), prompt_len=10),  # E2E 0.2, TPOT 50 ms
        make_result(1, ttft=0.2, gaps=(0.1, 0.1), prompt_len=20),  # E2E 0.4, TPOT 100 ms
        make_result(2, ttft=0.4, gaps=(), prompt_len=30),  # one token: E2E 0.4, no TPOT
        make_result(3, error="RuntimeError: boom"),  # failed: in no other metric
    ]
    m = compute_metrics(results, duration_s=2.0, slos_ms={"ttft": 250, "tpot": 60})
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 7)
    assert m.request_throughput == pytest.approx(3 / 2)
    assert m.output_throughput == pytest.approx(7 / 2)
    assert m.total_token_throughput == pytest.approx(67 / 2)
    # TTFT 100, 200, 400 ms: p99 sits at rank 0.99 * 2 = 1.98, i.e. 200 + 0.98 * (400 - 200)
    assert (m.ttft.mean, m.ttft.median, m.ttft.p99) == pytest.approx((700 / 3, 200, 396))
    # TPOT 50 and 100 ms (the one-token request has none): p99 at rank 0.99 -> 50 + 0.99 * 50
    assert (m.tpot.mean, m.tpot.median, m.tpot.p99) == pytest.approx((75, 75, 99.5))
    # ITL: gaps 50, 50, 100, 100 ms pooled; p99 at rank 2.97 -> 100
    assert (m.itl.mean, m.itl.median, m.itl.p99) == pytest.approx((75, 75, 100))
    assert (m.e2el.mean, m.e2el.median) == pytest.approx((1000 / 3, 400))
    # goodput: request 0 meets both SLOs, request 1 misses TPOT, request 2 misses TTFT -> 1 in 2 s
    assert m.request_goodput == pytest.approx(0.5)
    assert m.as_json()["p99_ttft_ms"] == pytest.approx(396)


def test_goodput_slos():
    r = make_result(ttft=0.1, gaps=(0.05, 0.05))  # TTFT 100 ms, TPOT 50 ms, E2E 200 ms
    assert meets_slos(r, {"ttft": 100, "tpot": 50, "e2el": 200})  # limits are inclusive
    assert not meets_slos(r, {"ttft": 99})
    assert not meets_slos(r, {"tpot": 49})
    assert not meets_slos(r, {"e2el": 199})
    assert meets_slos(make_result(ttft=0.1, gaps=()), {"tpot": 1})  # one token: no TPOT to miss
    assert meets_slos(r, {})


def test_metrics_without_samples_are_none():
    m = compute_metrics([make_result(error="x")], duration_s=1.0)
    assert (m.completed, m.failed, m.request_goodput) == (0, 1, 0)
    assert m.ttft.median is None and m.as_json()["p99_e2el_ms"] is None
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0)


@pytest.mark.parametrize("text", ["ttft", "foo:1", "ttft:x", "tpot:0", "e2el:-5", "ttft:nan"])
def test_bad_slos_are_refused(text):
    with pytest.raises(ValueError):
        parse_slo(text)


def test_parse_slo():
    assert parse_slo("tpot:50") == ("tpot", 50.0)


def test_ratio_to_the_baseline_is_taken_at_the_same_load():
    loads = [Load(concurrency=1), Load(concurrency=4)]
    runs = [RunResult(b, load, [], 1.0) for b in ("base", "fast") for load in loads]
    metrics = [compute_metrics([make_result(gaps=(0.1,) * (n - 1))], 1.0) for n in (2, 4, 6, 20)]
    assert ratios_to_baseline(runs, metrics, "base") == pytest.approx([1, 1, 3, 5])  # 6/2 and 20/4 tokens/s
    assert ratios_to_baseline(runs, metrics, None) == [None] * 4


def test_token_agreement_compares_each_request_with_the_baselines_at_the_same_load():
    loads = [Load(concurrency=1), Load(concurrency=4)]
    base = [RunResult("base", load, [make_result(i) for i in range(3)], 1.0) for load in loads]
    other = [make_result(i) for i in range(3)]
    other[1].output_token_ids = [9, 9, 9, 9]  # one request generated other tokens
    failed = make_result(2, error="boom")  # (a failed request is not compared)
    runs = base + [RunResult("spec", loads[0], other, 1.0), RunResult("spec", loads[1], other[:2] + [failed], 1.0)]
    assert token_agreement(runs, "base") == ["spec at concurrency 1: 2/3", "spec at concurrency 4: 1/2"]
    assert token_agreement(runs, None) == []


def test_arrival_times_are_seeded_gamma_gaps_with_mean_one_over_rate():
    times = arrival_times_s(4001, rate=4.0, burstiness=0.5, seed=7)
    assert times == arrival_times_s(4001, rate=4.0, burstiness=0.5, seed=7)
    assert times != arrival_times_s(4001, rate=4.0, burstiness=0.5, seed=8)
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 4000 == pytest.approx(0.25, rel=0.1)
    assert arrival_times_s(3, rate=math.inf, burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]


def test_load_is_either_a_concurrency_or_a_rate():
    with pytest.raises(ValueError):
        Load()
    with pytest.raises(ValueError):
        Load(concurrency=2, request_rate=1.0)
    assert Load(request_rate=math.inf).as_json() == {"request_rate": "inf", "burstiness": 1.0}


class ToyBackend:
    """Answers each request with one token after `delay` s; records how many were in flight at most and, for
    static batching, the batches it got."""

    name = "toy"

    def __init__(self, static_batching=False, delay=0.01):
        self.static_batching, self.delay = static_batching, delay
        self.in_flight = self.max_in_flight = 0
        self.batches = []

    async def generate(self, request):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = asyncio.get_running_loop().time()
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        if request.index == 2:
            raise RuntimeError("request 2 fails\nsecond line")
        return make_result(request.index, ttft=self.delay, gaps=(), start=start)

    async def generate_batch(self, requests, start_times_s):
        self.batches.append([r.index for r in requests])
        await asyncio.sleep(self.delay)
        return [make_result(r.index, start=s) for r, s in zip(requests, start_times_s)]


def toy_requests(n):
    return [BenchRequest(i, "x", (1, 2), 1) for i in range(n)]


def test_closed_loop_keeps_concurrency_requests_in_flight_and_records_failures():
    backend = ToyBackend()
    run = asyncio.run(run_streaming(backend, toy_requests(7), Load(concurrency=3), 0, tqdm(disable=True)))
    assert backend.max_in_flight == 3
    assert [r.index for r in run.results] == list(range(7))
    assert run.results[2].error == "RuntimeError: request 2 fails"
    assert compute_metrics(run.results, run.duration_s).failed == 1


def test_static_batches_have_concurrency_requests_in_order():
    backend = ToyBackend(static_batching=True)
    run = asyncio.run(run_static(backend, toy_requests(7), Load(concurrency=3), 0, tqdm(disable=True)))
    assert backend.batches == [[0, 1, 2], [3, 4, 5], [6]]
    assert [r.index for r in run.results] == list(range(7))


def test_static_batches_in_an_open_loop_take_what_has_arrived():
    backend = ToyBackend(static_batching=True, delay=0.05)
    run = asyncio.run(run_static(backend, toy_requests(5), Load(request_rate=math.inf), 0, tqdm(disable=True)))
    assert backend.batches == [[0, 1, 2, 3, 4]]
    assert len(run.results) == 5


# -- workloads -----------------------------------------------------------------------------------------------
def test_workloads_are_deterministic_for_a_seed(tokenizer):
    a = build_requests("mixed", tokenizer, 20, seed=3)
    assert a == build_requests("mixed", tokenizer, 20, seed=3)
    assert [r.prompt for r in a] != [r.prompt for r in build_requests("mixed", tokenizer, 20, seed=4)]


def test_prompts_are_raw_text_that_tokenizes_to_their_ids(tokenizer):
    for r in build_requests("decode-heavy", tokenizer, 30, seed=0):
        assert list(r.prompt_token_ids) == tokenizer(r.prompt, add_special_tokens=False).input_ids


def test_decode_heavy_lengths(tokenizer):
    requests = build_requests("decode-heavy", tokenizer, 50, seed=1)
    assert all(20 <= r.prompt_len <= 60 and r.output_len == 128 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10  # spread over the range


def test_mixed_lengths(tokenizer):
    requests = build_requests("mixed", tokenizer, 50, seed=2)
    assert all(65 <= r.prompt_len <= 540 for r in requests)
    outputs = [r.output_len for r in requests]
    assert (outputs.count(16), outputs.count(128)) == (40, 10)
    assert outputs != sorted(outputs)  # the long ones are spread out


def test_fixed_lengths_are_exact_and_default_to_1000_and_16(tokenizer):
    assert {(r.prompt_len, r.output_len) for r in build_requests("fixed", tokenizer, 6, 0, 300, 7)} == {(300, 7)}
    assert {(r.prompt_len, r.output_len) for r in build_requests("fixed", tokenizer, 3, 0)} == {(1000, 16)}
    long = build_requests("fixed", tokenizer, 1, 0, 9000, 1)  # longer than the corpus: it repeats
    assert long[0].prompt_len == 9000


def test_copy_prompts_end_with_their_passages_start(tokenizer):
    from tandem.benchmarks.bench.workloads import COPY_ECHO_TOKENS

    for r in build_requests("copy", tokenizer, 5, seed=0):
        assert r.output_len == 40
        assert list(r.prompt_token_ids) == tokenizer(r.prompt, add_special_tokens=False).input_ids
        echo = tokenizer.decode(r.prompt_token_ids[:COPY_ECHO_TOKENS], clean_up_tokenization_spaces=False)
        assert r.prompt.endswith("\n\n" + echo)  # (the passage's first tokens again, after a blank line)
        passage = r.prompt.removesuffix("\n\n" + echo)
        assert 100 <= len(tokenizer(passage, add_special_tokens=False).input_ids) <= 300
    assert {r.output_len for r in build_requests("copy", tokenizer, 3, 0, output_len=128)} == {128}


def test_unknown_workload(tokenizer):
    with pytest.raises(ValueError, match="unknown workload"):
        build_requests("nope", tokenizer, 1, 0)
