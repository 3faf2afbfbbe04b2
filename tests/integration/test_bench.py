"""`tandem bench` end to end: a real cluster (redis, gateway, prefill, decode processes) and the colocated
engine on the same tiny fixed workload; both run the same fp32 model, so their greedy tokens must agree."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # an end-to-end load/benchmark run: .ci/run, when it has time
REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 32, 4


def test_bench_cluster_and_colocated_complete_every_request_with_the_same_tokens(tmp_path, model_dir):
    out = tmp_path / "bench.json"
    threads = os.environ.get("TANDEM_TEST_THREADS", "2")
    argv = [sys.executable, "-m", "tandem.services", "bench", "--backend", "cluster,colocated", "--workload", "fixed",
            "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--concurrency", "2", "--threads", threads, "--engine-args", "--num-blocks 64 --threads 1",
            "--log-dir", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "cluster" in proc.stdout and "colocated" in proc.stdout  # the table

    doc = json.loads(out.read_text())
    runs = {run["backend"]: run for run in doc["runs"]}
    assert set(runs) == {"cluster", "colocated"}
    for name, run in runs.items():
        assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0), (name, [r["error"] for r in run["requests"]])
        assert run["load"] == {"concurrency": 2}
        assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert run["median_ttft_ms"] > 0 and run["median_tpot_ms"] > 0 and run["output_throughput"] > 0
        for request in run["requests"]:
            assert (request["prompt_len"], request["output_tokens"]) == (INPUT_LEN, OUTPUT_LEN), name
            assert len(request["itl_ms"]) == OUTPUT_LEN - 1
    for cluster_request, colocated_request in zip(runs["cluster"]["requests"], runs["colocated"]["requests"]):
        assert cluster_request["index"] == colocated_request["index"]
        assert cluster_request["output_token_ids"] == colocated_request["output_token_ids"]
    assert [r["prompt_len"] for r in doc["workload"]["requests_by_load"][0]] == [INPUT_LEN] * NUM_PROMPTS
