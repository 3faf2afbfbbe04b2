"""The `tandem` command: prepare-model, up (a local cluster), generate, chat."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

DEFAULT_GATEWAY = os.environ.get("TANDEM_GATEWAY", "127.0.0.1:50051")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None, help="most new tokens (server default 256)")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")


def _request(args, prompt: str, history=None):
    from services.client import make_request

    return make_request(prompt, args.raw, args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed,
                        args.stop, history)  # fmt: skip


def cmd_prepare_model(args) -> int:
    from shared.model_files import prepare_model

    print(prepare_model(args.out, force=args.force))
    return 0


def cmd_generate(args) -> int:
    from services.client import generate

    try:
        if args.json:
            print(json.dumps(generate(args.gateway, _request(args, args.prompt)).as_json(), ensure_ascii=False))
        else:
            generate(args.gateway, _request(args, args.prompt), on_text=lambda t: print(t, end="", flush=True))
            print()
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args) -> int:
    from services.client import generate

    history: list[tuple[str, str]] = []
    print("tandem chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            prompt = input("> ").strip()
        except EOFError:
            return 0
        if not prompt:
            return 0
        try:
            out = generate(args.gateway, _request(args, prompt, history), on_text=lambda t: print(t, end="", flush=True))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            continue
        print()
        history += [("user", prompt), ("assistant", out.text)]


def cmd_up(args) -> int:
    from services.client import generate
    from services.launcher import LocalCluster
    from shared.model_files import prepare_model

    model = args.model or str(prepare_model())
    engine_args = ["--block-size", str(args.block_size), "--threads", str(args.threads)]
    prefill_args = engine_args + ["--max-num-batched-tokens", str(args.prefill_chunk)]
    cluster = LocalCluster(model, args.port, args.prefill, args.decode, prefill_args, engine_args, log_dir=args.log_dir)
    print(f"starting redis, {args.decode} decode, {args.prefill} prefill and a gateway (logs: {cluster.log_dir})",
          file=sys.stderr)  # fmt: skip
    with cluster:
        print(f"gateway listening on {cluster.gateway_address}", flush=True)
        if args.prompt is not None:
            print(f"> {args.prompt}", file=sys.stderr)
            out = generate(cluster.gateway_address, _request(args, args.prompt), on_text=lambda t: print(t, end="", flush=True))
            print(f"\n[{out.finish_reason}: {out.completion_tokens} tokens, TTFT {out.ttft_ms:.0f} ms, "
                  f"total {out.e2e_ms:.0f} ms]", file=sys.stderr)  # fmt: skip
            return 0
        print("serving; Ctrl-C to stop. Try: tandem generate --gateway "
              f"{cluster.gateway_address} \"What is the capital of France?\"", file=sys.stderr)  # fmt: skip
        try:
            while True:
                cluster.check_alive()
                time.sleep(1)
        except KeyboardInterrupt:
            print("\nstopping", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving: gateway, prefill, decode")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert the packaged SmolLM2 GGUF to an HF directory (once)")
    p.add_argument("--out", default=None, help="target directory (default: the user cache)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prepare_model)

    p = sub.add_parser("up", help="run a local cluster (redis, gateway, prefill, decode) in the foreground")
    p.add_argument("--model", default=os.environ.get("TANDEM_MODEL"))
    p.add_argument("--port", type=int, default=50051, help="gateway port")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512, help="prefill max_num_batched_tokens per step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--prompt", default=None, help="send this prompt, print the answer, and shut down")
    add_sampling_args(p)
    p.set_defaults(func=cmd_up)

    for name, func, help_ in (("generate", cmd_generate, "send one prompt"), ("chat", cmd_chat, "interactive chat")):
        p = sub.add_parser(name, help=help_)
        if name == "generate":
            p.add_argument("prompt")
            p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
        p.add_argument("--gateway", default=DEFAULT_GATEWAY, help="HOST:PORT of the gateway")
        add_sampling_args(p)
        p.set_defaults(func=func)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
