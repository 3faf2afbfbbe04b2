"""Serving metrics of one run, named as vLLM's `vllm bench serve` prints them.

Per request (RequestResult): TTFT = first token message - send; E2E latency (e2el) = complete - send;
TPOT = (E2E - TTFT) / (output tokens - 1), for requests with at least 2 output tokens; ITL = the gaps between
consecutive token messages (all requests' gaps pooled). Per run: throughputs over duration_s, the wall time from
the first send to the last completion; statistics over completed requests only (failed ones count in `failed`);
percentiles interpolate linearly between order statistics (numpy's default). Goodput counts the requests that
meet every SLO given (vLLM's --goodput): ttft, tpot and e2el in milliseconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tandem.benchmarks.bench.backends.base import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_GOODPUT = {"ttft": 500.0, "tpot": 50.0}  # ms
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Summary:
    """Mean, median and 99th percentile of one latency in milliseconds; None when there is no sample."""

    mean: float | None
    median: float | None
    p99: float | None

    @classmethod
    def of(cls, values_s: list[float]) -> Summary:
        if not values_s:
            return cls(None, None, None)
        ms = np.asarray(values_s, dtype=np.float64) * 1000
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass(frozen=True)
class BenchmarkMetrics:
    """One run's metrics. Throughputs per second of duration_s; latencies in ms; request_goodput in req/s."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary

    def as_json(self) -> dict:
        """Flat, with vLLM's key names: mean_ttft_ms, median_ttft_ms, p99_ttft_ms, ..."""
        out = {k: v for k, v in asdict(self).items() if k not in LATENCIES}
        for name in LATENCIES:
            for stat, value in asdict(getattr(self, name)).items():
                out[f"{stat}_{name}_ms"] = value
        return out


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (a one-token request has no TPOT: it meets that one)."""
    values_ms = {"ttft": result.ttft_s * 1000, "e2el": result.e2e_s * 1000,
                 "tpot": (result.tpot_s or 0.0) * 1000}  # fmt: skip
    return all(values_ms[name] <= limit for name, limit in slos_ms.items())


def compute_metrics(results: list[RequestResult], duration_s: float,
                    slos_ms: dict[str, float] = DEFAULT_GOODPUT) -> BenchmarkMetrics:
    """Metrics of one run from its requests (completed and failed) and its wall time in seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        request_goodput=sum(meets_slos(r, slos_ms) for r in done) / duration_s,
        ttft=Summary.of([r.ttft_s for r in done]),
        tpot=Summary.of([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Summary.of([gap for r in done for gap in r.itl_s]),
        e2el=Summary.of([r.e2e_s for r in done]),
    )


def parse_slo(text: str) -> tuple[str, float]:
    """'ttft:500' -> ('ttft', 500.0). ValueError on an unknown metric or a value that is not a positive number."""
    name, sep, value = text.partition(":")
    if not sep or name not in SLO_METRICS:
        raise ValueError(f"expected METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}, got {text!r}")
    try:
        limit = float(value)
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not a number of milliseconds") from None
    if not limit > 0:
        raise ValueError(f"{name}: the SLO must be positive, got {value}")
    return name, limit
