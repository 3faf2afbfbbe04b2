"""The backends `tandem bench` compares, by name, and how each is built from the command line's settings."""
from __future__ import annotations

from tandem.benchmarks.bench.backends.base import Backend
from tandem.shared.config import SPECULATIVE_METHODS

# cluster-<method>: the cluster with --speculative-method <method> added to --engine-args (one run compares them)
SPECULATING_CLUSTERS = tuple(f"cluster-{method}" for method in SPECULATIVE_METHODS if method != "draft")
BACKENDS = ("cluster", *SPECULATING_CLUSTERS, "colocated", "hf-static", "llama-server", "vllm", "openai")
DEFAULT_BACKENDS = ("cluster", "colocated", "hf-static")  # + llama-server when its binary is found
LLAMA_DEFAULT_SLOTS = 32
LLAMA_MIN_CTX_PER_SLOT = 2048  # tokens


def create_backend(name: str, args, model_dir: str, max_in_flight: int, max_request_len: int) -> Backend:
    """The named backend, configured from the parsed `tandem bench` arguments.

    max_in_flight: the most requests in flight at once (the largest concurrency, or every request for a
    request rate); max_request_len: the longest prompt + output in tokens (sizes llama-server's slots and vLLM's
    --max-model-len)."""
    if name == "cluster" or name in SPECULATING_CLUSTERS:
        import dataclasses

        from tandem.benchmarks.bench.backends.cluster import ClusterBackend

        engine_args = args.engine_args
        if name != "cluster":
            if args.gateway:
                raise ValueError(f"backend {name} starts its own cluster: it does not go with --gateway")
            engine_args = dataclasses.replace(engine_args, speculative_method=name.removeprefix("cluster-"))
        backend = ClusterBackend(model_dir, engine_args, args.gateway, args.log_dir, args.request_timeout)
        backend.name = name
        return backend
    if name == "colocated":
        from tandem.benchmarks.bench.backends.colocated import ColocatedBackend

        return ColocatedBackend(model_dir, args.engine_args, args.threads, args.request_timeout)
    if name == "hf-static":
        from tandem.benchmarks.bench.backends.hf_static import HFStaticBackend

        return HFStaticBackend(model_dir, args.threads)
    if name == "llama-server":
        from tandem.benchmarks.bench.backends.llama_server import LlamaServerBackend, find_llama_server
        from tandem.shared.model_files import packaged_gguf_path

        slots = args.llama_slots or max(LLAMA_DEFAULT_SLOTS, max_in_flight)
        ctx_per_slot = max(LLAMA_MIN_CTX_PER_SLOT, -(-max_request_len // 256) * 256)
        threads = args.llama_threads or args.threads
        return LlamaServerBackend(find_llama_server(args.llama_server), str(packaged_gguf_path()), threads,
                                  slots, ctx_per_slot, max_in_flight, args.log_dir, args.request_timeout)  # fmt: skip
    if name in ("vllm", "openai"):
        from tandem.benchmarks.bench.backends.openai_compat import OpenAIBackend
        from tandem.benchmarks.bench.backends.vllm import VLLMServer, find_vllm_python

        if name == "openai":
            return OpenAIBackend(name, args.openai_url, max_in_flight, args.request_timeout, args.openai_model)
        server = VLLMServer(find_vllm_python(args.vllm_python), model_dir, args.vllm_dtype, args.threads,
                            max_request_len, args.log_dir)  # fmt: skip
        return OpenAIBackend(name, None, max_in_flight, args.request_timeout, server=server)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
