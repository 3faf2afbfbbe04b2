"""PNG plots of a benchmark (--plot DIR), drawn with matplotlib's Agg backend (no display needed).

    cdf_<load>.png      per load level: the CDFs of TTFT, TPOT and E2E latency (ms), one line per backend
    throughput.png      output tokens/s and requests/s against the load, one line per backend
    p99_latency.png     p99 TTFT, TPOT and E2E latency (ms) against the load, one line per backend
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from tandem.benchmarks.bench.metrics import BenchmarkMetrics
from tandem.benchmarks.bench.runner import RunResult

CDF_METRICS = (("TTFT", lambda r: r.ttft_s), ("TPOT", lambda r: r.tpot_s), ("E2E latency", lambda r: r.e2e_s))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "_", text.lower()).strip("_")


def write_plots(runs: list[RunResult], metrics: list[BenchmarkMetrics], out_dir: str) -> list[Path]:
    """Write the PNGs into out_dir (created if missing); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    backends = list(dict.fromkeys(run.backend for run in runs))
    loads = list(dict.fromkeys(run.load for run in runs))

    for load in loads:
        fig, axes = plt.subplots(1, len(CDF_METRICS), figsize=(15, 4.2))
        for ax, (title, value_of) in zip(axes, CDF_METRICS):
            for run in (r for r in runs if r.load == load):
                values = sorted(v * 1000 for v in (value_of(r) for r in run.results if r.ok) if v is not None)
                if values:
                    fractions = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, fractions, where="post", label=run.backend)
            ax.set(title=f"{title} CDF, {load.label}", xlabel=f"{title} (ms)", ylabel="fraction of requests",
                   ylim=(0, 1.02))  # fmt: skip
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        written.append(_save(plt, fig, out / f"cdf_{_slug(load.label)}.png"))

    x_label = "concurrency (requests in flight)" if loads[0].concurrency is not None else "request rate (req/s)"
    panels = (("output tokens/s", lambda m: m.output_throughput), ("requests/s", lambda m: m.request_throughput))
    written.append(_against_load(plt, runs, metrics, backends, panels, x_label, "Throughput", out / "throughput.png"))
    panels = (("p99 TTFT (ms)", lambda m: m.ttft.p99), ("p99 TPOT (ms)", lambda m: m.tpot.p99),
              ("p99 E2E latency (ms)", lambda m: m.e2el.p99))  # fmt: skip
    written.append(_against_load(plt, runs, metrics, backends, panels, x_label, "p99 latency",
                                 out / "p99_latency.png"))  # fmt: skip
    return written


def _against_load(plt, runs, metrics, backends, panels, x_label: str, title: str, path: Path) -> Path:
    """One panel per (y label, metric getter), one line per backend over the load levels."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (y_label, value_of) in zip(axes, panels):
        for backend in backends:
            points = [(run.load.value, value_of(m)) for run, m in zip(runs, metrics) if run.backend == backend]
            points = [(x, y) for x, y in points if y is not None and math.isfinite(x)]
            if points:
                ax.plot(*zip(*points), marker="o", label=backend)
        ax.set(title=f"{title}: {y_label}", xlabel=x_label, ylabel=y_label)
        if len({run.load.value for run in runs}) > 2:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
