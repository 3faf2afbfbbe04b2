"""Talking to a running cluster from tests, and a redis-server a test controls."""
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import redis

from tandem.services.client import generate
from tandem.v1 import common_pb2, common_pb2_grpc, gateway_pb2


def greedy_request(kind: str, text: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    from tandem.services.client import make_request

    return make_request(text, raw=(kind == "raw"), max_tokens=max_tokens, temperature=0.0)


def generate_all(address: str, requests: list[gateway_pb2.GenerateRequest]):
    """Send all requests at once (several in flight) and return their Completions in order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: generate(address, r, timeout=600), requests))


def load(address: str) -> common_pb2.InstanceLoad:
    """Instance.GetLoad of an engine instance (either tier)."""
    with grpc.insecure_channel(address) as channel:
        return common_pb2_grpc.InstanceStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10)


def wait_all_blocks_free(cluster, timeout_s: float = 30) -> dict[str, common_pb2.InstanceLoad]:
    """Poll every engine instance until its pool is entirely free; return the last loads seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {name: load(addr) for name, addr in cluster.addresses.items()}
        if all(l.num_free_blocks == l.num_blocks for l in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


def wait_idle(cluster, names=None, timeout_s: float = 60) -> dict[str, common_pb2.InstanceLoad]:
    """Poll the engine instances named (default: all) until each has every block free and no request running or
    waiting; return the last loads seen (the caller asserts on them)."""
    addresses = {name: cluster.addresses[name] for name in (names or cluster.addresses)}
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {name: load(address) for name, address in addresses.items()}
        if time.monotonic() > deadline or all(
                (l.num_free_blocks, l.num_running, l.num_waiting) == (l.num_blocks, 0, 0) for l in loads.values()):
            return loads
        time.sleep(0.2)


def kv_transfer(decode_address: str, model_config, request_id: str, num_blocks: int, first_token_id: int = 5,
                first_block_index: int = 0, block_size: int = 16, max_bytes: int = 4 * 1024 * 1024) -> list:
    """A complete, valid TransferKV stream of zeros (float32 KV) for blocks first_block_index.. of a request
    reserved on a decode: its data messages (at most max_bytes of data each), then the last message with
    first_token_id and the totals."""
    import torch

    from tandem.services.kv_wire import kv_to_messages, last_message
    from tandem.shared.kv_connector import KVBlocks

    shape = (model_config.num_hidden_layers, 2, num_blocks, block_size, model_config.num_key_value_heads,
             model_config.head_dim)  # fmt: skip
    messages = kv_to_messages(request_id, KVBlocks(first_block_index, torch.zeros(shape)), model_config, max_bytes)
    model_id = load(decode_address).model_id
    for m in messages:
        m.model_id = model_id
    return messages + [last_message(request_id, first_token_id, len(messages), num_blocks)]


class RedisServer:
    """A redis-server child on a fixed loopback port that a test can stop, restart and pause; with password, it
    runs with --requirepass and url carries the password."""

    def __init__(self, password: str | None = None):
        from tandem.services.launcher import free_port

        self.port, self.proc, self.password = free_port(), None, password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"

    def start(self):
        from tandem.services.launcher import redis_server_binary

        self.proc = subprocess.Popen([redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no",
                                      *(["--requirepass", self.password] if self.password else [])],
                                     stdout=subprocess.DEVNULL)  # fmt: skip
        client, deadline = redis.Redis(port=self.port, password=self.password), time.monotonic() + 10
        while True:
            try:
                client.ping()
                return client.close()
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.02)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)

    def pause(self):
        """SIGSTOP: the server is frozen (connections stay open, nothing answers) until resume()."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)


def rss_mb(pid: int) -> float:
    """Resident set size of a process (VmRSS in /proc/<pid>/status), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def metric_samples(url: str, name: str) -> dict[frozenset, float]:
    """{frozenset of (label, value): sample value} of one metric family's samples at a Prometheus endpoint."""
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {frozenset(s.labels.items()): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}  # fmt: skip


def tracebacks(cluster) -> dict[str, int]:
    """{service: number of tracebacks in its log} for every service log of a LocalCluster with any."""
    counts = {path.stem: path.read_text(errors="replace").count("Traceback") for path in cluster.log_dir.glob("*.log")}
    return {name: n for name, n in counts.items() if n}


def hf_constrained(hf_model, model_config, ids: list[int], grammar: str, max_new_tokens: int) -> list[int]:
    """The reference for structured output: HF transformers fp32 greedy under llguidance's own mask of grammar (a
    processor reading LLMatcher.compute_logit_bias, not the engine's bitmask path), cut where the grammar is
    complete (the engine stops there; HF goes on to the EOS the grammar then allows)."""
    from pathlib import Path

    import llguidance
    import torch

    from tandem.shared.structured_output import grammar_eos_ids

    vocab = model_config.vocab_size
    eos = grammar_eos_ids(model_config.path, model_config.eos_token_ids)
    tokenizer = llguidance.LLTokenizer((Path(model_config.path) / "tokenizer.json").read_text(), n_vocab=vocab,
                                       eos_token=list(eos))  # fmt: skip
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    consumed = []

    def mask(input_ids, scores):
        for t in input_ids[0, len(ids) + len(consumed):].tolist():
            assert matcher.consume_token(t), matcher.get_error()
            consumed.append(t)
        allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
        return scores.masked_fill(~allowed, float("-inf"))

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                logits_processor=[mask])[0, len(ids):].tolist()  # fmt: skip
    replay = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    for i, t in enumerate(out):
        replay.consume_token(t)
        if replay.is_stopped():
            return out[: i + 1]
    return out
