"""Adapter-aware routing (docs/lora.md "Routing"): which instances hold a request's LoRA adapter, and what serving it
on one that does not costs, in the router's currency: tokens of work before the request's first token.

Each engine publishes the adapters it has loaded in its registry record (InstanceInfo.lora_adapters: name -> its
digest, directory, and whether its weights are in memory now) and the seconds it measured to load one
(InstanceInfo.lora_load_s). An instance holds an adapter when it has it loaded with the cluster's files and in
memory; elsewhere the request waits for a load: the instance reads the directory (again, if it dropped the weights:
an engine keeps --max-cpu-loras adapters in memory), or the gateway first loads it there (placement.py). That wait
costs load_s x tokens_per_s tokens, what the instance could have computed meanwhile, the same price the router puts
on a prefix hit below the pool. So a holder wins unless its queue is deeper than a load elsewhere by more than that.

Before an instance has measured its load time it is taken to load as slowly as the slowest that has; when none has
measured one (or its rate is not measured yet), a non-holder costs infinitely much: nothing moves off a holder
before a cost is known (as the local-prefill rule waits for measured rates). With no holder in a tier, the load
costs alike everywhere, and the queue alone decides.

The cluster's identity of an adapter is its name and the digest of its files. Instances listing one name with other
files (an operator loaded a new version on some) are not candidates for its requests: KV and tokens must never mix
versions; the digest most instances hold is the cluster's (ties: the one listed first by instance id).
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

from tandem.shared.cluster_state.registry import InstanceInfo

log = logging.getLogger(__name__)
# why the instance chosen for an adapter's request was chosen (tandem:router_lora_decisions_total{reason})
LORA_REASONS = ("holder", "load_cheaper", "load_no_holder")


def lora_key(name: str, digest: str) -> str:
    """An adapter's identity as the engines hash it into a request's first block (shared/lora/peft.py lora_key)."""
    return f"{name}:{digest}"


@dataclass(frozen=True)
class ClusterAdapter:
    """A LoRA adapter of the cluster: its name, the digest of its files and the directory to load it from."""

    name: str
    digest: str
    path: str

    @property
    def key(self) -> str:
        return lora_key(self.name, self.digest)


def cluster_adapters(instances: list[InstanceInfo]) -> dict[str, ClusterAdapter]:
    """Every adapter some instance has loaded, by name, with the digest most of them list for it (the module's
    docstring)."""
    listed: dict[str, list[tuple[str, str]]] = {}
    for instance in sorted(instances, key=lambda i: i.instance_id):
        for name, entry in instance.lora_adapters.items():
            listed.setdefault(name, []).append((entry.get("digest", ""), entry.get("path", "")))
    adapters = {}
    for name, entries in sorted(listed.items()):
        counts = Counter(digest for digest, _ in entries)
        digest = max(counts, key=lambda d: (counts[d], -[e[0] for e in entries].index(d)))
        adapters[name] = ClusterAdapter(name, digest, next(path for d, path in entries if d == digest))
    return adapters


class AdapterPlan:
    """One request's adapter against the candidates of a route: who holds it and what a load costs each other one.
    loaded: instance ids the gateway loaded it on moments ago, which their records may not list yet."""

    def __init__(self, adapter: ClusterAdapter, candidates: list[InstanceInfo], loaded: set[str] = frozenset()):
        self.adapter = adapter
        self._loaded = loaded
        measured = [i.lora_load_s for i in candidates if i.lora_load_s > 0]
        self._fallback_s = max(measured, default=0.0)

    def serves(self, instance: InstanceInfo) -> bool:
        """Whether the instance can serve the adapter's requests: it has no other files under its name."""
        entry = instance.lora_adapters.get(self.adapter.name)
        return entry is None or entry.get("digest") == self.adapter.digest

    def no_prefill(self) -> str:
        """Why no prefill is a candidate when each live one holds other files under the adapter's name."""
        return (f"no prefill serves adapter {self.adapter.name} with the cluster's files (digest "
                f"{self.adapter.digest}): each live prefill holds other files under its name")

    def loaded(self, instance: InstanceInfo) -> bool:
        """Whether the instance has the adapter loaded (in memory or not), or the gateway just loaded it there."""
        return self.adapter.name in instance.lora_adapters or instance.instance_id in self._loaded

    def holds(self, instance: InstanceInfo) -> bool:
        """Loaded there with its weights in memory: its requests wait for no load. The record says so once it lists
        the adapter; before that, a load by this gateway moments ago does (its weights are in memory then, but a
        record listing them as dropped since, by later loads past --max-cpu-loras, is believed)."""
        entry = instance.lora_adapters.get(self.adapter.name)
        if entry is not None:
            return bool(entry.get("resident"))
        return instance.instance_id in self._loaded

    def load_s(self, instance: InstanceInfo) -> float:
        """The seconds a load there takes: its measured time, else the slowest measured one; 0: none known."""
        return instance.lora_load_s or self._fallback_s

    @staticmethod
    def stalled(instance: InstanceInfo) -> int:
        """The requests a load there holds up: an engine reads an adapter on its step thread, so on a decode every
        request it serves waits too, the new one included (a prefill's queue is in its cost already)."""
        return 1 + (instance.num_running + instance.num_waiting if instance.tier == "decode" else 0)

    def raw_cost(self, instance: InstanceInfo) -> float:
        """Tokens of work a load there costs: load_s x tokens_per_s per request it stalls (0 for a holder; inf while
        the cost is not known)."""
        if self.holds(instance):
            return 0.0
        tokens = self.load_s(instance) * instance.tokens_per_s * self.stalled(instance)
        return tokens if tokens > 0 else math.inf

    def costs(self, candidates: list[InstanceInfo]) -> dict[str, float]:
        """{instance id: raw_cost}, but all 0 when no candidate holds the adapter (each must load it: the queue
        decides) and the costs are not all known."""
        costs = {c.instance_id: self.raw_cost(c) for c in candidates}
        if not any(self.holds(c) for c in candidates) and math.inf in costs.values():
            return dict.fromkeys(costs, 0.0)
        return costs

    def explain(self, instance: InstanceInfo, cost: float) -> str:
        """A candidate's part of the decision log."""
        if self.holds(instance):
            return f", holds adapter {self.adapter.name}"
        where = "reads it again" if self.loaded(instance) else "loads it"
        if math.isinf(cost):
            return f", {where}: adapter {self.adapter.name} (load time not measured yet: not moved off a holder)"
        stalled = self.stalled(instance)
        return (f", {where}: adapter {self.adapter.name} +{cost:.0f} to load "
                f"({self.load_s(instance) * 1e3:.0f} ms at {instance.tokens_per_s:.0f} tokens/s"
                + (f", x {stalled} requests it stalls)" if stalled > 1 else ")"))

    def reason(self, chosen: InstanceInfo, candidates: list[InstanceInfo]) -> str:
        """LORA_REASONS' entry for the instance chosen among candidates."""
        if self.holds(chosen):
            return "holder"
        return "load_cheaper" if any(self.holds(c) for c in candidates) else "load_no_holder"


def annotate(route, plan: AdapterPlan | None, decodes: list[InstanceInfo], prefills: list[InstanceInfo]):
    """route (router.Route) with its adapter's part: why each chosen instance was chosen among the candidates
    (route.lora_reasons, and a line of its decision log) and where the adapter must be loaded first
    (route.lora_loads). Returns route; unchanged without a plan (a base-model request)."""
    if plan is None:
        return route
    route.lora = plan.adapter
    notes = []
    for tier, chosen, candidates in (("decode", route.decode, decodes), ("prefill", route.prefill, prefills)):
        if chosen is None:
            continue
        route.lora_reasons[tier] = reason = plan.reason(chosen, candidates)
        if not plan.loaded(chosen):
            route.lora_loads.append(chosen)
        notes.append(f"{tier} {chosen.instance_id} " + {
            "holder": "holds it", "load_no_holder": "loads it (no candidate holds it)",
            "load_cheaper": "loads it (cheaper than queueing behind a holder)"}[reason])  # fmt: skip
    route.explanation.append(f"adapter {plan.adapter.name}: {'; '.join(notes)}")
    return route


class RecentLoRAChanges:
    """The loads and unloads this gateway made, which the engines' records show only a heartbeat or two later:
    each counts for ttl_s (the registry's TTL), so a request right after a load finds its adapter, and one right
    after an unload does not."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._loaded: dict[tuple[str, str], tuple[float, ClusterAdapter]] = {}  # (instance id, key) -> (until, it)
        self._unloaded: dict[str, float] = {}  # name -> until

    def loaded(self, instance_id: str, adapter: ClusterAdapter) -> None:
        self._loaded[(instance_id, adapter.key)] = (time.monotonic() + self.ttl_s, adapter)
        self._unloaded.pop(adapter.name, None)

    def unloaded(self, name: str) -> None:
        self._loaded = {k: v for k, v in self._loaded.items() if v[1].name != name}
        self._unloaded[name] = time.monotonic() + self.ttl_s

    def loaded_on(self, adapter: ClusterAdapter) -> set[str]:
        """Instance ids adapter was loaded on lately."""
        now = time.monotonic()
        return {iid for (iid, key), (until, _) in self._loaded.items() if key == adapter.key and until > now}

    def apply(self, adapters: dict[str, ClusterAdapter]) -> dict[str, ClusterAdapter]:
        """adapters (cluster_adapters of the records) with the recent loads and without the recent unloads."""
        now = time.monotonic()
        recent = {a.name: a for until, a in self._loaded.values() if until > now}
        return {name: a for name, a in sorted((recent | adapters).items()) if self._unloaded.get(name, 0) <= now}

    def expire(self) -> None:
        now = time.monotonic()
        self._loaded = {k: v for k, v in self._loaded.items() if v[0] > now}
        self._unloaded = {k: until for k, until in self._unloaded.items() if until > now}
