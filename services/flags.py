"""Command-line flags, built from one source: EngineArgs' fields for engine settings (shared/engine_args.py), and
the table below for where a service listens. Environment defaults come from shared/envs.py.

Imports neither torch nor the engine, so the `tandem` CLI can build its parser quickly.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import fields

from tandem.services.logs import LOG_FORMATS
from tandem.services.security import add_api_key_args, add_tls_args, redacted_url
from tandem.shared import envs
from tandem.shared.engine_args import TIER_DEFAULTS, EngineArgs, non_negative_number
from tandem.shared.request import SamplingParams


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none (None, False): those say in their help what happens."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


DEFAULT_METRICS_PORT = 9090  # engine services' Prometheus endpoint (the gateway's is on its --http-port)
MIN_KV_LEASE_S = 2.0
DEFAULT_KV_LEASE_S = 10.0  # (a live prefill sends something every 0.5 s, queued prompts included)
DEFAULT_YIELD_TO_PREFILL_MS = 100.0  # a decode's step interval while a prefill on its CPUs is backed up
DEFAULT_DRAIN_TIMEOUT_S = 30.0  # (deploy/k8s gives pods 45 s to stop: the drain and some room)
DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_WAITING_REQUESTS = 256, 1024  # gateway admission (TGI's default: 128)
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_MAX_MIGRATIONS = 3  # times a completion whose decode fails mid-stream is placed again (gateway)
DEFAULT_SESSION_MAX_LOAD = 2048  # tokens a session's instance may be loaded above its tier's least loaded (gateway)
DEFAULT_SESSION_TTL_S = 600.0  # seconds a gateway remembers a session's pair after its last request
MAX_SESSIONS = 100_000  # sessions one gateway remembers (each entry about 0.5 KB)
# Flags read from an environment variable of another name than TANDEM_<FLAG> (names the ecosystem uses)
ENV_NAMES = {"redis_url": "REDIS_URL", "otlp_traces_endpoint": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
EXCLUDES = {"num_blocks": "memory_utilization", "memory_utilization": "num_blocks"}  # settings giving one thing
SECRET_SETTINGS = ("api_key",)  # masked in settings_line (and so are the passwords of URLs)


def env_name(dest: str) -> str:
    """The environment variable that sets a service flag: --block-size -> TANDEM_BLOCK_SIZE (ENV_NAMES aside)."""
    return ENV_NAMES.get(dest, f"TANDEM_{dest.upper()}")


def apply_env(parser: argparse.ArgumentParser, argv: list[str] | None = None, skip: tuple[str, ...] = ()) -> None:
    """Make each flag of parser (but those in skip) default to its environment variable (env_name) when set,
    converted and checked as the flag would be, and name the variable in its help. A flag given on the command
    line (argv, default sys.argv[1:]) still wins, also over the variable of a setting it excludes (--num-blocks
    and --memory-utilization). A bad value ends the program as a bad flag does (exit 2), naming the variable:
    "$TANDEM_BLOCK_SIZE='x': invalid positive_int value". Run it after the last add_argument."""
    argv = sys.argv[1:] if argv is None else argv
    given = {a.dest for a in parser._actions for option in a.option_strings
             for token in argv if token == option or token.startswith(option + "=")}  # fmt: skip
    actions = [a for a in parser._actions if a.option_strings and a.dest not in ("help", *skip)]
    defaults = {}
    for action in actions:
        name = env_name(action.dest)
        if action.help and f"${name}" not in action.help:
            action.help += f" (${name})"
        if action.default == argparse.SUPPRESS:  # (tandem up's per-tier settings: its children read the variable)
            continue
        raw = os.environ.get(name, "")
        if raw and EXCLUDES.get(action.dest) not in given:
            defaults[action.dest] = _env_value(parser, action, name, raw)
    chosen = given | set(defaults)
    for action in actions:  # a setting chosen drops the default of the one it excludes (no default pool size)
        if EXCLUDES.get(action.dest) in chosen and action.dest not in chosen:
            defaults[action.dest] = None
    parser.set_defaults(**defaults)


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str):
    if action.nargs == 0:  # a switch (--standalone, --no-enable-prefix-caching): a boolean
        if raw.lower() not in _TRUE + _FALSE:
            parser.error(f"${name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
        return raw.lower() in _TRUE
    try:
        if action.nargs == "+":  # (several values, separated by whitespace: TANDEM_LORA_MODULES="a=DIR b=DIR")
            return [action.type(item) if action.type else item for item in raw.split()]
        value = action.type(raw) if action.type else raw
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"invalid {action.type.__name__} value"
        parser.error(f"${name}={raw!r}: {detail}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"${name}={raw!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def settings_line(name: str, args: argparse.Namespace) -> str:
    """What a service prints at start: every setting it runs with, flags and environment resolved; secrets
    (SECRET_SETTINGS, passwords in URLs such as --redis-url's) masked."""
    values = {k: "***" if k in SECRET_SETTINGS and v else v for k, v in vars(args).items()}
    return redacted_url(f"{name} settings: {json.dumps(values, sort_keys=True, default=str)}")


def implied_engine_settings(args: argparse.Namespace) -> argparse.Namespace:
    """An engine service's args with the settings other flags imply, as the engine runs them (so that its settings
    line says what runs): --lora-modules turns on --enable-lora."""
    args.enable_lora = bool(args.enable_lora or args.lora_modules)
    return args


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


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def http_port_number(value: str) -> int:
    """argparse type: a port, 0 (any free one) or -1 (no HTTP API)."""
    return -1 if value.strip() == "-1" else port_number(value)


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return number


def lease_seconds(value: str) -> float:
    """A KV lease: at least MIN_KV_LEASE_S, four of the prefill's keepalive intervals (services/prefill/server.py)."""
    number = positive_float(value)
    if number < MIN_KV_LEASE_S:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_KV_LEASE_S:g} seconds, got {value!r}")
    return number


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
    whose default depends on the tier takes tier's (with tier None, as for `tandem up`, it is left out of the
    namespace unless given). The environment variables come with apply_env."""
    for f in fields(EngineArgs):
        meta = f.metadata
        if meta["group"] not in groups:
            continue
        default = f.default
        help_ = meta["help"]
        if f.name in TIER_DEFAULTS["decode"]:
            per_tier = ", ".join(f"{t} {values[f.name]}" for t, values in TIER_DEFAULTS.items())
            default = TIER_DEFAULTS[tier][f.name] if tier else argparse.SUPPRESS
            help_ += "" if tier else f" (default: {per_tier})"
        if meta["type"] is bool:  # --name / --no-name
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=help_, default=default)
            continue
        kind = {str: _path, int: positive_int, float: unit_fraction}.get(meta["type"], meta["type"])
        kind = str if meta["choices"] else kind
        parser.add_argument(_flag(f.name), *map(_flag, meta["aliases"]), type=kind, choices=meta["choices"],
                            help=help_, default=default, nargs=meta["nargs"])


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
        elif isinstance(value, (tuple, list)):  # (a flag of several values: --lora-modules)
            argv += [_flag(f.name), *map(str, value)]
        else:
            argv += [_flag(f.name), str(value)]
    return argv


def gateway_policy_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_gateway_policy_args whose values in args differ from their defaults: what `tandem up`
    passes to its gateway."""
    parser = argparse.ArgumentParser()
    add_gateway_policy_args(parser)
    return [a for action in parser._actions if action.option_strings and action.dest != "help"
            and getattr(args, action.dest) != action.default
            for a in (action.option_strings[0], str(getattr(args, action.dest)))]  # fmt: skip


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def add_listen_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Where a service listens: --host, --port (0 picks a free one); how long it drains when told to stop."""
    parser.add_argument("--host", default="0.0.0.0", help="address to bind")
    parser.add_argument("--port", type=port_number, default=default_port, help="gRPC port (0 picks a free one)")
    add_drain_arg(parser)


def add_drain_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drain-timeout", type=positive_float, default=DEFAULT_DRAIN_TIMEOUT_S,
                        help="seconds a stopping service (SIGTERM) gives its requests in flight to finish; new ones "
                             "are refused meanwhile, and those still running then are cancelled")  # fmt: skip


def add_tier_parallel_args(parser: argparse.ArgumentParser) -> None:
    """`tandem up`: each tier's tensor-parallel size, over --tensor-parallel-size (which sets both)."""
    for tier in ("prefill", "decode"):
        parser.add_argument(f"--{tier}-tensor-parallel-size", type=positive_int, default=None,
                            help=f"the {tier}s' --tensor-parallel-size (default: --tensor-parallel-size); the tiers "
                                 "may differ: each rank ships its KV heads to the ranks holding them "
                                 "(docs/parallelism.md)")  # fmt: skip


def add_registry_args(parser: argparse.ArgumentParser, required_unless: str = "") -> None:
    parser.add_argument("--redis-url", default=None,
                        help=f"Redis holding the instance registry; required{required_unless}. A password and TLS "
                             "go in the URL: redis://:PASSWORD@HOST:6379/0, rediss://HOST:6380/0?ssl_ca_certs=CA.pem "
                             "(docs/security.md)")  # fmt: skip


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    """Logs and traces of a service (services/logs.py, services/tracing.py)."""
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text, or json: one object per line with tier, instance and request ids")
    parser.add_argument("--otlp-traces-endpoint", default=envs.OTEL_EXPORTER_OTLP_ENDPOINT,
                        help="send OpenTelemetry traces over OTLP/gRPC to this URL, e.g. http://127.0.0.1:4317 "
                             "($OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT); none: no "
                             "tracing")  # fmt: skip


def add_engine_service_args(parser: argparse.ArgumentParser, tier: str) -> None:
    """Every flag of an engine service (tier "prefill" or "decode")."""
    add_engine_args(parser, tier=tier)
    add_listen_args(parser, default_port=0)
    add_registry_args(parser, required_unless=" unless --standalone")
    add_observability_args(parser)
    add_tls_args(parser)
    parser.add_argument("--advertise-host", default=None,
                        help="host or IP other services use to reach this one (default: this host's IP)")
    parser.add_argument("--standalone", action="store_true",
                        help="serve without a registry (nothing can route to this instance but direct calls)")
    if tier == "decode":
        parser.add_argument("--kv-lease-timeout", type=lease_seconds, default=DEFAULT_KV_LEASE_S,
                            help="seconds a reservation waits with no message from its prefill (KV, or a keepalive "
                                 "every 0.5 s) before its blocks are freed and the gateway places the request again "
                                 "(a prefill that died or froze)")
        parser.add_argument("--yield-to-prefill-ms", type=non_negative_number, default=DEFAULT_YIELD_TO_PREFILL_MS,
                            help="while a prefill instance running on this instance's CPUs (one machine, a CPU in "
                                 "common) has over a second of prompts queued, by its measured rate, start a step at "
                                 "most every this many ms, leaving the CPUs to it in between: a longer TPOT for a "
                                 "shorter TTFT (docs/performance.md; 0: never)")
    parser.add_argument("--metrics-port", type=port_number, default=DEFAULT_METRICS_PORT,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port)")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, groups=("model",))
    add_listen_args(parser, default_port=50051)
    add_registry_args(parser)
    add_observability_args(parser)
    add_tls_args(parser, public=True)
    add_api_key_args(parser)
    parser.add_argument("--http-port", type=http_port_number, default=8000,
                        help="port of the OpenAI-compatible HTTP API on --host (0: any free port; -1: none)")
    add_gateway_policy_args(parser)


def add_gateway_policy_args(parser: argparse.ArgumentParser) -> None:
    """The gateway's serving policy: defaults, naming, routing, admission (`tandem up` takes them too)."""
    parser.add_argument("--default-max-tokens", type=positive_int, default=SamplingParams.max_tokens,
                        help="max_tokens of a request that does not set it")
    parser.add_argument("--served-model-name", default=None,
                        help="model name of the HTTP API (/v1/models; requests may name it); default: the model "
                             "directory's name")  # fmt: skip
    parser.add_argument("--routing", choices=("cache-aware", "round-robin"), default="cache-aware",
                        help="cache-aware: the cost model of docs/prefix-caching.md; round-robin: ignore the prefix "
                             "index and queues")  # fmt: skip
    parser.add_argument("--local-prefill-tokens", type=non_negative_int, default=64,
                        help="when the chosen decode lacks at most this many prompt tokens, it computes them itself "
                             "and no prefill is called (0: only fully cached prompts)")  # fmt: skip
    parser.add_argument("--session-affinity-max-load", type=non_negative_int, default=DEFAULT_SESSION_MAX_LOAD,
                        help="a request naming a session (X-Session-Id header, GenerateRequest.session_id) stays on "
                             "its session's prefill/decode pair while each is at most this many tokens more loaded "
                             "than its tier's least loaded instance (prefill: queued tokens; decode: queued tokens + "
                             "256 per request); beyond it the cost model places it and the session moves")
    parser.add_argument("--session-affinity-ttl", type=positive_float, default=DEFAULT_SESSION_TTL_S,
                        help="seconds the gateway remembers a session's pair after its last request (at most "
                             f"{MAX_SESSIONS} sessions, least recently used forgotten first)")  # fmt: skip
    parser.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "mistral", "json"),
                        default="auto", help="how answers to requests with tools are read for tool calls "
                        "(docs/api.md); auto: the format the chat template shows")  # fmt: skip
    parser.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                        help="split <think> ... </think> reasoning from answers into reasoning_content "
                             "(docs/api.md); default: none, answers are all content")  # fmt: skip
    parser.add_argument("--max-migrations", type=non_negative_int, default=DEFAULT_MAX_MIGRATIONS,
                        help="times a request whose decode fails after its first token (dies, freezes, drains past "
                             "its timeout, loses the prompt's KV) is placed again with the tokens it has and goes "
                             "on; past that, or 0, it fails with UNAVAILABLE")  # fmt: skip
    parser.add_argument("--max-concurrent-requests", type=positive_int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                        help="requests served at once; more wait for a turn, best priority first")
    parser.add_argument("--max-waiting-requests", type=non_negative_int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests that may wait for a turn; one more is refused at once (RESOURCE_EXHAUSTED / "
                             "HTTP 429 with a retry hint)")  # fmt: skip
    parser.add_argument("--queue-timeout", type=positive_float, default=DEFAULT_QUEUE_TIMEOUT_S,
                        help="seconds a request may wait for a turn, or for room on a decode while every KV pool is "
                             "full, before it is refused (RESOURCE_EXHAUSTED / HTTP 429 with a retry hint)")


def settings_table() -> str:
    """The README's table of every service setting (Markdown): flag, environment variable, default in each
    service ("-": the service has no such flag), meaning; built from the parsers in an environment without the
    variables, so it shows the code's defaults. `python -m tandem.services.flags` prints it."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("TANDEM_", "OTEL_")) or k == "REDIS_URL"}
    try:
        parsers = {}
        for service in ("prefill", "decode", "gateway"):
            parsers[service] = argparse.ArgumentParser()
            if service == "gateway":
                add_gateway_args(parsers[service])
            else:
                add_engine_service_args(parsers[service], service)
    finally:
        os.environ.update(saved)
    actions = {service: {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}
               for service, p in parsers.items()}  # fmt: skip
    dests = list(dict.fromkeys([*actions["decode"], *actions["gateway"]]))
    rows = ["| flag | environment | prefill | decode | gateway | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for dest in dests:
        cells = [_default_cell(actions[service].get(dest)) for service in parsers]
        action = next(actions[service][dest] for service in parsers if dest in actions[service])
        meaning = action.help.replace(f" (${env_name(dest)})", "").replace("|", "\\|")
        rows.append(f"| `{action.option_strings[0]}` | `{env_name(dest)}` | {' | '.join(cells)} | {meaning} |")
    return "\n".join(rows)


def _default_cell(action: argparse.Action | None) -> str:
    if action is None:
        return "-"
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    return "none" if action.default is None else str(action.default)


def own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


if __name__ == "__main__":
    print(settings_table())
