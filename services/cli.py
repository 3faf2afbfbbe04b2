"""The `tandem` command: prepare-model, up (a local cluster), generate, chat, quantize, eval-quant, bench.

The client side (generate, chat) imports neither torch, redis nor the engine: each command imports what it
needs when it runs, and quantize / eval-quant / bench build their flags only when they are the command given.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import signal
import socket
import sys
import time

import grpc

from tandem.services.flags import (HelpFormatter, add_drain_arg, add_engine_args, add_gateway_policy_args,
                           add_observability_args, add_tier_parallel_args, apply_env, engine_argv,
                           gateway_policy_argv, port_number, positive_int)
from tandem.services.security import (add_api_key_args, add_client_tls_args, add_tls_args, api_keys_from_args,
                               client_tls_from_args, tls_from_args)
from tandem.shared import envs
from tandem.shared.engine_args import EngineArgs

# Offline tools (they need torch): command -> (help, module with add_args(parser) and run(args))
TOOLS = {
    "quantize": ("write a weight-only INT8/INT4 checkpoint (RTN, GPTQ, AWQ, LLM.int8, mixed precision) or rank "
                 "layers by sensitivity",
                 "tandem.tools.quantize", "add_quantize_args", "run_quantize"),
    "eval-quant": ("KL / top-1 / task score / decode speed of quantized formats against fp32",
                   "tandem.tools.eval_quant", "add_eval_args", "run_eval"),
    "bench": ("serving benchmark: TTFT / TPOT / ITL / throughput of the cluster and other backends",
              "tandem.benchmarks.bench.cli", "add_bench_args", "run_bench"),
}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="most new tokens (server default 256)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string, not included in the text (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--cache-salt", default=None, help="prefix-cache salt: requests with different salts never share "
                   "cached KV (e.g. one per tenant)")
    p.add_argument("--session-id", default=None, help="session affinity key: requests naming one session stay on "
                   "one prefill/decode pair while their load is within the gateway's bound (docs/api.md)")
    p.add_argument("--lora-name", default=None, help="the LoRA adapter to generate with, by the name it was loaded "
                   "under (GET /v1/models lists them; default: the base model; docs/lora.md)")


def _request(args, prompt: str, history=None):
    from tandem.services.client import make_request

    return make_request(prompt, raw=args.raw, max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop, history=history,
                        ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, session_id=args.session_id,
                        lora_name=args.lora_name)  # fmt: skip


def _print_text(text: str) -> None:
    print(text, end="", flush=True)


def _stream_to_terminal(address: str, request, tls=None, api_key: str | None = None):
    """Stream one answer to stdout; a note on stderr when it was cut by max_tokens or aborted."""
    from tandem.services.client import generate

    out = generate(address, request, on_text=_print_text, tls=tls, api_key=api_key)
    print()
    if out.finish_reason != "stop":
        print(f"[{out.finish_reason}: {out.completion_tokens} tokens]", file=sys.stderr)
    return out


def cmd_prepare_model(args) -> int:
    from tandem.tools.prepare_model import prepare_model

    print(prepare_model(args.out, force=args.force))
    return 0


def cmd_generate(args) -> int:
    from tandem.services.client import generate

    tls = client_tls_from_args(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        if args.json:
            out = generate(args.gateway, _request(args, prompt), tls=tls, api_key=args.api_key)
            print(json.dumps(out.as_json(), ensure_ascii=False))
        else:
            _stream_to_terminal(args.gateway, _request(args, prompt), tls, args.api_key)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # closing the stream cancels the request on every tier
        print("\n[cancelled]", file=sys.stderr)
        return 130
    return 0


def cmd_chat(args) -> int:
    tls = client_tls_from_args(args)
    history: list[tuple[str, str]] = []
    print("tandem chat: empty line or Ctrl-D to quit; Ctrl-C stops an answer", file=sys.stderr)
    while True:
        try:
            prompt = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not prompt:
            return 0
        try:
            out = _stream_to_terminal(args.gateway, _request(args, prompt, history), tls, args.api_key)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            print("\n[cancelled]", file=sys.stderr)
            continue
        history += [("user", prompt), ("assistant", out.text)]


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the services bind: TIME_WAIT is no conflict)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(f"error: port {port} is in use; pass --port N for gRPC or --http-port N for the HTTP "
                             "API (make serve PORT=N HTTP_PORT=M), 0 for any free port")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_up(args) -> int:
    from tandem.services.launcher import LocalCluster, free_port
    from tandem.tools.prepare_model import prepare_model

    # SIGTERM stops the cluster like Ctrl-C; SIGINT works even when a background shell started us ignoring it.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    port = args.port if args.port is not None else (0 if args.prompt is not None else 50051)
    http_port = args.http_port if args.http_port is not None else (0 if args.prompt is not None else 8000)
    for p in (port, http_port):
        if p:
            _check_port_free(p)
    engine_args = EngineArgs.from_namespace(args)
    if engine_args.model is None:
        prepare_model()  # (the services find the converted default model; its default weights are the GGUF)
    model = engine_args.model
    engine_args = dataclasses.replace(engine_args, model=None)  # LocalCluster gives --model to every process
    observability = ["--log-format", args.log_format] + (
        ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else [])
    engine_flags = engine_argv(engine_args) + observability
    prefill_args, decode_args = tier_engine_args(args, engine_flags)
    tls, api_keys = tls_from_args(args), api_keys_from_args(args)
    cluster = LocalCluster(model=model, gateway_port=port or free_port(), http_port=http_port or free_port(),
                           num_prefill=args.prefill,
                           num_decode=args.decode, prefill_args=prefill_args, decode_args=decode_args,
                           gateway_args=engine_argv(engine_args, groups=("model",)) + observability
                           + gateway_policy_argv(args),
                           log_dir=args.log_dir, drain_timeout_s=args.drain_timeout, tls=tls,
                           api_keys=api_keys.keys if api_keys else ())  # fmt: skip
    print(f"starting redis, {args.decode} decode, {args.prefill} prefill and a gateway (logs: {cluster.log_dir})",
          file=sys.stderr)  # fmt: skip
    try:
        cluster.start()
        print(f"gateway listening on {cluster.gateway_address}; OpenAI-compatible API at {cluster.openai_base_url}",
              flush=True)  # fmt: skip
        print("metrics: " + ", ".join(f"{name} {url}" for name, url in cluster.metrics_urls.items()), flush=True)
        if args.prompt is not None:
            print(f"> {args.prompt}", file=sys.stderr)
            out = _stream_to_terminal(cluster.gateway_address, _request(args, args.prompt), tls,
                                      api_keys.keys[0] if api_keys else None)  # fmt: skip
            print(f"[{out.finish_reason}: {out.completion_tokens} tokens, TTFT {out.ttft_ms:.0f} ms, "
                  f"total {out.e2e_ms:.0f} ms]", file=sys.stderr)  # fmt: skip
            return 0
        secure = [*(["--tls-ca-file", tls.ca_file] if tls and tls.ca_file else ["--tls"] if tls else []),
                  *(["--tls-cert-file", tls.cert_file, "--tls-key-file", tls.key_file]
                    if tls and args.tls_client_auth == "require" else []),
                  *(["--tls-server-name", tls.server_name] if tls and tls.server_name else []),
                  *(["--api-key", "KEY"] if api_keys else [])]  # fmt: skip
        print(f"serving; Ctrl-C to stop. Try: {sys.argv[0]} generate --gateway {cluster.gateway_address} "
              f"{' '.join(secure + [''])}\"What is the capital of France?\"", file=sys.stderr)  # fmt: skip
        while True:
            cluster.supervise()  # (a child that exits is started again; one that keeps failing ends the cluster)
            time.sleep(1)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: while starting, serving or answering --prompt
        print(f"\nstopping: each service finishes its requests (up to {args.drain_timeout:.0f} s)", file=sys.stderr)
        return 130 if args.prompt is not None else 0
    finally:
        # NOTE: a second Ctrl-C/SIGTERM must not cut the stop short: the children end with this process (their
        # parent-death signal, services/launcher.py), so leaving early would SIGKILL them mid-drain.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()


def tier_engine_args(args, engine_flags: list[str]) -> tuple[list[str], list[str]]:
    """`tandem up`'s engine flags for the prefills and the decodes: engine_flags to both, then --prefill-chunk to
    the prefills and each tier's --<tier>-tensor-parallel-size over --tensor-parallel-size (the last flag wins)."""
    chunk = ["--max-num-batched-tokens", str(args.prefill_chunk)] if args.prefill_chunk is not None else []
    prefill_tp, decode_tp = (["--tensor-parallel-size", str(size)] if size is not None else []
                             for size in (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size))
    return engine_flags + chunk + prefill_tp, engine_flags + decode_tp


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving: gateway, prefill, decode")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = HelpFormatter

    p = sub.add_parser("prepare-model", help="convert the packaged SmolLM2 GGUF to an HF directory (once)")
    p.add_argument("--out", default=None, help="target directory (default: $TANDEM_CACHE/models/...)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prepare_model)

    up_text = ("Every engine flag is passed to each prefill and decode process (python -m tandem.services.decode --help); "
               "--prefill-chunk to the prefills only, --prefill- and --decode-tensor-parallel-size to their tier; the "
               "gateway's policy flags (routing, admission) to the gateway.")
    p = sub.add_parser("up", help="run a local cluster (redis, gateway, prefill, decode) in the foreground",
                       formatter_class=defaults, description=up_text)
    add_engine_args(p)
    p.add_argument("--port", type=port_number, default=None,
                   help="gateway port on 127.0.0.1 (default 50051; 0 = any free port, the default with --prompt)")
    p.add_argument("--http-port", type=port_number, default=None,
                   help="the gateway's OpenAI-compatible HTTP port on 127.0.0.1 (default 8000; 0 = any free port, "
                        "the default with --prompt)")  # fmt: skip
    p.add_argument("--prefill", type=positive_int, default=1, help="prefill instances")
    p.add_argument("--decode", type=positive_int, default=1, help="decode instances")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="the prefills' --max-num-batched-tokens (default: theirs, 512)")
    add_tier_parallel_args(p)
    p.add_argument("--log-dir", default=None, help="where each process logs (default: a new temp dir)")
    add_observability_args(p)  # (passed to every process)
    add_drain_arg(p)
    add_tls_args(p, public=True)  # (the same files for every process: one identity, docs/security.md)
    add_api_key_args(p)  # (the gateway's)
    add_gateway_policy_args(p)
    if argv[:1] == ["up"]:  # (the same environment variables as the services; not for --prompt's sampling flags)
        apply_env(p, argv)
    p.add_argument("--prompt", default=None, help="send this prompt, print the answer, and shut down")
    add_sampling_args(p)
    p.set_defaults(func=cmd_up)

    for name, (help_, module, add_args, run) in TOOLS.items():
        p = sub.add_parser(name, help=help_)
        if name in argv[:1]:  # the command given: only now import it (and torch)
            tool = importlib.import_module(module)
            getattr(tool, add_args)(p)
            p.set_defaults(func=getattr(tool, run))

    for name, func, help_ in (("generate", cmd_generate, "send one prompt"), ("chat", cmd_chat, "interactive chat")):
        p = sub.add_parser(name, help=help_)
        if name == "generate":
            p.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
            p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
        p.add_argument("--gateway", default=envs.TANDEM_GATEWAY, help="HOST:PORT of the gateway ($TANDEM_GATEWAY)")
        p.add_argument("--api-key", default=envs.TANDEM_API_KEY,
                       help="send 'authorization: Bearer KEY' (the gateway's --api-key; $TANDEM_API_KEY)")
        add_client_tls_args(p)
        add_sampling_args(p)
        p.set_defaults(func=func)
    return parser


def main(argv=None) -> None:
    """Run one subcommand; a bad argument, unreadable file or dead cluster process ends it with one
    "error: ..." line on stderr and exit code 1, not a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        sys.exit(args.func(args))
    except grpc.RpcError as e:
        sys.exit(f"error: {e.code().name}: {e.details()}")
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
