"""Command-line flags, built from one source: EngineArgs' fields for engine settings (shared/config.py), and
the table below for where a service listens. Environment defaults come from shared/envs.py.

Imports neither torch nor the engine, so the `tandem` CLI can build its parser quickly.
"""
from __future__ import annotations

import argparse
import socket
from dataclasses import fields

from services.logs import LOG_FORMATS
from shared import envs
from shared.config import TIER_DEFAULTS, EngineArgs
from shared.request import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none (None, False): those say in their help what happens."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


DEFAULT_METRICS_PORT = 9090  # engine services' Prometheus endpoint (the gateway's is on its --http-port)

def positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def unit_fraction(value: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        fraction = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}") from None
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}")
    return fraction


def port_number(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0-65535 (0: any free port), got {value}")
    return number


def _path(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must name a checkpoint (a directory or a file), not be empty")
    return value


def add_engine_args(parser: argparse.ArgumentParser, groups: tuple[str, ...] = ("model", "engine"),
                    tier: str | None = None) -> None:
    """One flag per EngineArgs field in groups ("model": what the gateway needs to name the model too;
    "engine": the rest). --block-size for block_size; type, help, choices and default from the field; a field
    with an environment variable defaults to it; a field whose default depends on the tier takes tier's (with
    tier None, as for `tandem up`, it is left out of the namespace unless given)."""
    for f in fields(EngineArgs):
        meta = f.metadata
        if meta["group"] not in groups:
            continue
        default = f.default
        help_ = meta["help"]
        if meta["env"]:
            from_env = getattr(envs, meta["env"])
            default = default if from_env is None else from_env
            help_ += f" (${meta['env']})"
        if f.name in TIER_DEFAULTS["decode"]:
            per_tier = ", ".join(f"{t} {values[f.name]}" for t, values in TIER_DEFAULTS.items())
            default = TIER_DEFAULTS[tier][f.name] if tier else argparse.SUPPRESS
            help_ += "" if tier else f" (default: {per_tier})"
        if meta["type"] is bool:  # --name / --no-name
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_, default=default)
            continue
        kind = {str: _path, int: positive_int, float: unit_fraction}.get(meta["type"], meta["type"])
        kind = str if meta["choices"] else kind
        parser.add_argument(_flag(f.name), type=kind, choices=meta["choices"], help=help_, default=default)


def engine_argv(engine_args: EngineArgs, groups: tuple[str, ...] = ("model", "engine")) -> list[str]:
    """The flags that give a service these settings (fields in groups that are not None): what `tandem up`
    passes to the processes it starts."""
    argv = []
    for f in fields(EngineArgs):
        value = getattr(engine_args, f.name)
        if f.metadata["group"] not in groups or value is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else _flag(f"no_{f.name}"))
        else:
            argv += [_flag(f.name), str(value)]
    return argv


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_listen_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Where a service listens: --host, --port (0 picks a free one)."""
    parser.add_argument("--host", default="0.0.0.0", help="address to bind")
    parser.add_argument("--port", type=port_number, default=default_port, help="0 picks a free port")


def add_registry_args(parser: argparse.ArgumentParser, required_unless: str = "") -> None:
    parser.add_argument("--redis-url", default=envs.REDIS_URL,
                        help=f"Redis holding the instance registry ($REDIS_URL); required{required_unless}")


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """Logs and traces of a service (services/logs.py, services/tracing.py)."""
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=envs.TANDEM_LOG_FORMAT,
                        help="text, or json: one object per line with tier, instance and request ids "
                             "($TANDEM_LOG_FORMAT)")  # fmt: skip
    parser.add_argument("--otlp-traces-endpoint", default=envs.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
                        or envs.OTEL_EXPORTER_OTLP_ENDPOINT,
                        help="send OpenTelemetry traces over OTLP/gRPC to this URL, e.g. http://127.0.0.1:4317 "
                             "($OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT); none: no "
                             "tracing")  # fmt: skip


def add_engine_service_args(parser: argparse.ArgumentParser, tier: str) -> None:
    """Every flag of an engine service (tier "prefill" or "decode")."""
    add_engine_args(parser, tier=tier)
    add_listen_args(parser, default_port=0)
    add_registry_args(parser, required_unless=" unless --standalone")
    add_observability_args(parser)
    parser.add_argument("--advertise-host", default=envs.TANDEM_ADVERTISE_HOST or _own_address(),
                        help="host or IP other services use to reach this one ($TANDEM_ADVERTISE_HOST, else this "
                             "host's IP)")  # fmt: skip
    parser.add_argument("--standalone", action="store_true",
                        help="serve without a registry (nothing can route to this instance but direct calls)")
    parser.add_argument("--metrics-port", type=port_number, default=DEFAULT_METRICS_PORT,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port)")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, groups=("model",))
    add_listen_args(parser, default_port=50051)
    add_registry_args(parser)
    add_observability_args(parser)
    parser.add_argument("--default-max-tokens", type=int, default=SamplingParams.max_tokens,
                        help="max_tokens of a request that does not set it")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="port of the OpenAI-compatible HTTP API on --host (0: any free port; -1: none)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name of the HTTP API (/v1/models; requests may name it); default: the model "
                             "directory's name")  # fmt: skip
    parser.add_argument("--routing", choices=("cache-aware", "round-robin"), default="cache-aware",
                        help="cache-aware: the cost model of docs/prefix-caching.md; round-robin: ignore the prefix "
                             "index and queues")  # fmt: skip
    parser.add_argument("--local-prefill-tokens", type=int, default=64,
                        help="when the chosen decode lacks at most this many prompt tokens, it computes them itself "
                             "and no prefill is called (0: only fully cached prompts)")  # fmt: skip


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
