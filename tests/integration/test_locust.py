"""benchmarks/locustfile.py run headless against the session cluster: both user classes (gRPC and the OpenAI HTTP
API) complete requests without a failure, each generating max_tokens tokens, and each has a TTFT entry, one per
request, no later than its end-to-end times."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # an end-to-end load/benchmark run: .ci/run, when it has time
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
REQUESTS = {"grpc Generate", "POST /v1/completions"}  # each as "Type Name" of locust's stats


def test_locust_drives_grpc_and_http_with_ttft_entries(tmp_path, cluster, model_dir):
    argv = [sys.executable, "-m", "locust", "-f", "benchmarks/locustfile.py", "--headless", "--only-summary",
            "-u", "2", "-r", "2", "-t", "20s", "--host", cluster.openai_base_url.removesuffix("/v1"),
            "--grpc-target", cluster.gateway_address, "--model-dir", str(model_dir),
            "--max-tokens", str(MAX_TOKENS), "--long-prompt-tokens", "200",
            "--csv", str(tmp_path / "locust"), "GrpcUser", "OpenAIUser"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, output  # locust exits 1 when any request failed

    with open(tmp_path / "locust_stats.csv") as f:
        stats = {f"{row['Type']} {row['Name']}": row for row in csv.DictReader(f)}
    for name in REQUESTS:
        request, ttft = stats[name], stats[f"ttft {name}"]
        assert int(request["Request Count"]) > 0 and int(request["Failure Count"]) == 0, output
        assert float(request["Average Content Size"]) == MAX_TOKENS  # the size is the tokens generated
        assert ttft["Request Count"] == request["Request Count"] and int(ttft["Failure Count"]) == 0
        assert 0 < float(ttft["Average Response Time"]) <= float(request["Average Response Time"])
        assert float(ttft["Max Response Time"]) <= float(request["Max Response Time"])
    assert "output tokens" in proc.stderr  # the token totals logged at the end
