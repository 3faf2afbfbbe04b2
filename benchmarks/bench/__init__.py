"""`tandem bench`: a serving benchmark (vLLM `bench serve` vocabulary) over several backends in one run.

    workloads.py   seeded requests cut from shipped English text (decode-heavy, mixed, fixed)
    backends/      cluster (gateway over gRPC), colocated (our engine in-process), hf-static (transformers
                   static batches), llama-server (llama.cpp over HTTP), vllm and openai (OpenAI's /v1/completions:
                   vLLM's CPU build started here, or any running server); base.py: RequestResult, the interface;
                   sse.py: streamed HTTP responses; server_process.py: a server the benchmark starts
    runner.py      load: closed loop (concurrency) or open loop (request rate, burstiness); one backend's session
    metrics.py     TTFT, TPOT, ITL, E2E latency, throughputs, goodput
    report.py      the table and the JSON;  plots.py: the PNGs;  benchmark.py: one benchmark end to end
    cli.py         the flags (`tandem bench`, `python -m tandem.benchmarks.bench`)
"""
