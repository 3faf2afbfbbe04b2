"""Routing: one cost model picks the prefill and the decode for a prompt, from the instances registered in Redis
and the prefix index (shared/cluster_state/prefix_index.py). docs/prefix-caching.md describes the model.

- Prefill: the fewest tokens to compute before this prompt's first token: the instance's queue
  (num_queued_tokens) plus the prompt minus its longest cached leading run there, plus the cost of bringing the
  part of that run held in its host or disk tier back into its pool (shared/kv_tiers.py): blocks x the seconds per
  block the instance measured for that tier (InstanceInfo.kv_tier_load_s) x its rate (tokens_per_s), i.e. the
  tokens it could have computed meanwhile. So a pool hit beats a host hit, which beats a disk hit, which beats
  computing, by measured costs; before a rate is measured a tier hit costs nothing extra and ties go to the
  instance holding more in its pool.
- Pairs: a prefill and a decode only when the prefill can send it KV (InstanceInfo.can_send_kv_to: KV dtype and
  block size, as a fleet changing --kv-dtype mixes them; with tensor parallelism on either side, records that list
  the decode's rank endpoints). A decode no prefill pairs with computes prompts itself, as every decode does while
  no prefill is left (none registered, each one marked down, or each one failed for the request being placed).
- Decode: among instances with room for the request, the highest score: prompt tokens it already holds in its
  pool (not shipped: received KV is reserved in the pool alone) minus DECODE_LOAD_TOKENS per request it serves or
  holds.
- Local prefill (conditional disaggregation): when the part of the prompt the chosen decode lacks is at most
  local_prefill_tokens, the decode computes it itself and no prefill is called. Past that, by measured cost: each
  instance publishes the tokens/s its recent steps computed (InstanceInfo.tokens_per_s), and the decode computes
  the prompt when its queue and the prompt over its rate, times the requests that wait while it does (its running
  ones and this one), is less than the prefill's queue and the prompt over the prefill's rate: when the prefill
  tier is the bottleneck, an idle decode takes the prompt; a busy one never does. Prompts a decode was given to
  compute in the last QUEUE_HINT_S count in its queue, which its record may not show yet.
The index learns of a prompt's blocks only as they are computed, so for ROUTED_HINT_S after sending a prompt to a
prefill the router also counts its blocks as held there: the next prompts sharing that prefix follow it instead
of computing it elsewhere (SGLang's router does the same with its approximate radix tree). Not for decodes: a
decode must not be asked to compute a prompt whose KV is still on its way to it.
Session affinity (session_affinity.py): a request naming a session the gateway knows goes to the pair its last
request used while each is live (registered with the same incarnation, not marked down, not skipped), the decode
has room, they share a KV format and each one's load (prefill: queued tokens; decode: queued tokens plus
DECODE_LOAD_TOKENS per request) is at most session_max_load tokens above the least loaded of its tier's
candidates; the rules above then run on that pair alone (the decode may still compute the prompt itself).
Otherwise the rules above place it, and the session moves to the pair they chose.
LoRA adapters (lora_routing.py): a request's adapter is part of its block hashes, so its prefix hits never cross
adapters; an instance that does not hold the adapter (loaded, in memory) pays the measured time of a load, in
tokens, on top of the rules above (prefill: added to its cost; decode: taken off its score), and instances holding
the adapter's name with other files are no candidates. Route.lora_loads lists the chosen instances the placement
loads it on first.
Ties go round-robin. Instances whose hash contract differs from the gateway's are never looked up in the index
(logged once each). If Redis cannot answer, routing is load-only until it can: after one failed lookup no request
waits for the index until a background probe finds it answering, and instances come from the registry's last
view (shared/cluster_state/registry.py). routing="round-robin" ignores the
index and queues (the baseline the benchmark compares against).

Over 400 lines on purpose: the cost model's state (routed hints, queued tokens, down marks) is read by route,
route_prefill and the pairing alike; what stands apart (sessions, LoRA) has its own module.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.services.flags import DEFAULT_SESSION_MAX_LOAD, DEFAULT_SESSION_TTL_S, MAX_SESSIONS
from tandem.services.gateway.lora_routing import (AdapterPlan, ClusterAdapter, RecentLoRAChanges, annotate,
                                                  cluster_adapters)
from tandem.services.gateway.session_affinity import SessionTable
from tandem.services.tracing import traced
from tandem.shared.block_hash import BlockHash, HashContract, hash_request_blocks
from tandem.shared.errors import NoInstanceError, UnknownLoRAError
from tandem.shared.kv_events import KV_TIERS
from tandem.shared.cluster_state.prefix_index import IndexUnavailableError, PrefixIndex
from tandem.shared.cluster_state.registry import InstanceInfo, Registry

log = logging.getLogger(__name__)
DECODE_LOAD_TOKENS = 256  # one running/waiting request on a decode weighs as much as 256 cached prompt tokens
ROUTING_POLICIES = ("cache-aware", "round-robin")
INDEX_PROBE_S = 1.0  # while the prefix index is down, how often it is asked whether it answers again
ROUTED_HINT_S = 10.0  # seconds a routed prompt's blocks count as held where it went, before the index shows them
QUEUE_HINT_S = 1.0  # seconds routed tokens count in an instance's queue (its record is republished every 0.5 s)


@dataclass
class SharedPrompt:
    """Requests that follow one placed prompt (the pipeline's n completions, beam search's steps): ready is set once
    the first request's decode (decode) holds the prompt's KV, or once it failed (decode None: the others place
    themselves); the others then go to that decode, whose prefix cache holds the prompt's blocks."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    decode: InstanceInfo | None = None


@dataclass
class Route:
    """Where one request goes, and why."""

    decode: InstanceInfo
    prefill: InstanceInfo | None  # None: the decode computes the prompt itself
    prefill_cached_tokens: int = 0  # per the index, in any tier
    decode_cached_tokens: int = 0  # in its pool
    explanation: list[str] = field(default_factory=list)  # each candidate's score, then the winners
    # the rule that chose: cache_aware, round_robin, decode_local, decode_local_cost, pinned, session_affinity
    reason: str = "cache_aware"
    # of prefill_cached_tokens, those in each tier (KV_TIERS; the routing hints count as "pool")
    prefill_cached_tiers: dict[str, int] = field(default_factory=dict)
    lora: ClusterAdapter | None = None  # the request's adapter (None: the base model)
    lora_reasons: dict[str, str] = field(default_factory=dict)  # tier -> lora_routing.LORA_REASONS' entry
    lora_loads: list[InstanceInfo] = field(default_factory=list)  # chosen instances that must load lora first

    def explain(self) -> str:
        return "; ".join(self.explanation)


def route_attributes(route: Route) -> dict:
    """What the trace's route span records (services/tracing.py)."""
    return dict(decode_instance_id=route.decode.instance_id, decode_cached_tokens=route.decode_cached_tokens,
                prefill_instance_id=route.prefill.instance_id if route.prefill else None,
                prefill_cached_tokens=route.prefill_cached_tokens, route_reason=route.reason,
                **{f"prefill_cached_{tier}_tokens": n for tier, n in route.prefill_cached_tiers.items() if n})


class Router:
    def __init__(self, registry: Registry, model_id: str, contract: HashContract, index: PrefixIndex | None,
                 policy: str = "cache-aware", local_prefill_tokens: int = 64,
                 kv_variant: Callable[[int], str | None] | None = None,
                 session_max_load: int = DEFAULT_SESSION_MAX_LOAD, session_ttl_s: float = DEFAULT_SESSION_TTL_S,
                 max_sessions: int = MAX_SESSIONS):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.registry, self.model_id, self.contract, self.index = registry, model_id, contract, index
        self.policy = policy
        self.local_prefill_tokens = local_prefill_tokens
        # (ModelConfig.kv_variant: the engines hash a longrope prompt past the original context apart)
        self.kv_variant = kv_variant or (lambda num_prompt_tokens: None)
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}
        self._mismatch_logged: set[str] = set()
        self._unpaired_logged: set[tuple[str, str]] = set()  # (prefill, decode) whose KV formats differ
        self._index_down = False
        # (instance id, incarnation) -> {block hash: when the hint expires}, oldest first
        self._routed: dict[tuple[str, str], OrderedDict[BlockHash, float]] = {}
        self._down: dict[str, float] = {}  # instance id -> until when routing avoids it (mark_down)
        # (instance id, incarnation) -> [(until when, prompt tokens a decode was given to compute)]
        self._queued: dict[tuple[str, str], list[tuple[float, int]]] = {}
        self.sessions = SessionTable(session_ttl_s, max_sessions)  # session affinity: each session's last pair
        self.session_max_load = session_max_load
        self.lora_changes = RecentLoRAChanges(registry.ttl_s)  # adapters this gateway loaded or unloaded lately

    async def instances(self, tier: str, skip: set[str], down_if_none: bool = True) -> list[InstanceInfo]:
        """Live instances of tier for this model, leaving out skip, and those marked down unless no other is
        left (down_if_none; False: never those). NoInstanceError when none is registered outside skip."""
        found = [i for i in await self.registry.list_instances(tier, self.model_id) if i.instance_id not in skip]
        if not found:
            raise NoInstanceError(f"no live {tier} instance is registered for model {self.model_id}")
        now = time.monotonic()
        return [i for i in found if self._down.get(i.instance_id, 0) <= now] or (found if down_if_none else [])

    async def _prefills(self, skip: set[str], local: bool) -> list[InstanceInfo]:
        """The prefills a request may go to: instances("prefill", skip); where the decode may compute the prompt
        itself (local), never those marked down, and none left is no error (the decode computes it)."""
        if not local:
            return await self.instances("prefill", skip)
        try:
            return await self.instances("prefill", skip, down_if_none=False)
        except NoInstanceError:
            return []

    def mark_down(self, instance: InstanceInfo) -> None:
        """A call to instance failed as unreachable or draining: route around it until its registry record has
        expired (one TTL), not only for the request that saw it fail."""
        if self._down.get(instance.instance_id, 0) <= time.monotonic():
            log.warning("%s %s is unreachable or draining: not routing to it", instance.tier, instance.instance_id)
        self._down[instance.instance_id] = time.monotonic() + self.registry.ttl_s

    @traced("route", result_attributes=route_attributes)
    async def route(self, prompt_ids: list[int], max_total_tokens: int, cache_salt: str | None = None,
                    skip: set[str] = frozenset(), local: bool = True, session_id: str | None = None,
                    keep_session: bool = True, lora_name: str | None = None) -> Route:
        """Pick a decode (with room for max_total_tokens when one has it) and a prefill (or none) for a prompt;
        local False: always a prefill (the request needs what only the prefill computes: prompt logprobs).
        session_id: the request's session (the module's docstring), which then moves to the pair chosen;
        keep_session False: the cost model places it even when its pair qualifies (a migrated request, whose
        decode just failed). lora_name: the request's adapter (the module's docstring; UnknownLoRAError naming it
        when no live instance has it loaded). No live prefill outside skip and not marked down: the decode computes
        the prompt itself (local; a prefill that died mid-prompt does not fail the request). NoInstanceError when no
        live decode is left outside skip, or no prefill and not local."""
        decodes = await self.instances("decode", skip)
        prefills = await self._prefills(skip, local)
        plan = None
        if lora_name is not None:
            lora = await self.adapter(lora_name)
            plan = AdapterPlan(lora, decodes + prefills, self.lora_changes.loaded_on(lora))
            decodes, prefills = [d for d in decodes if plan.serves(d)], [p for p in prefills if plan.serves(p)]
            if not decodes:
                raise NoInstanceError(f"no live decode serves adapter {lora.name!r} with its files (digest "
                                      f"{lora.digest}): others hold other files under its name")
            if not prefills and not local:
                raise NoInstanceError(plan.no_prefill())
        roomy = [d for d in decodes if d.num_free_blocks * d.block_size >= max_total_tokens]
        # (a fleet mid-way through a change of --kv-dtype or --block-size: only pairs that can move KV)
        paired = [d for d in roomy or decodes if any(p.can_send_kv_to(d) for p in prefills)] or roomy or decodes
        if session_id is None:
            return annotate(await self._route(prompt_ids, paired, prefills, cache_salt, local, plan), plan, paired,
                            prefills)
        kept, note = (None, f"session {session_id}: migrated, placed by the cost model") if not keep_session else (
            self.sessions.stay(session_id, decodes, roomy, paired, prefills, skip, self._down, self._session_load,
                               self.session_max_load))  # fmt: skip
        if kept is not None:
            paired, prefills = [kept[0]], [kept[1]] if kept[1] is not None else prefills
        route = annotate(await self._route(prompt_ids, paired, prefills, cache_salt, local, plan), plan, paired,
                         prefills)
        route.explanation.insert(0, note)
        if kept is not None:
            route.reason = "session_affinity"
        self.sessions.remember(session_id, route.decode, route.prefill)
        return route

    async def adapters(self) -> dict[str, ClusterAdapter]:
        """The LoRA adapters some live instance of this model has loaded, by name (lora_routing.cluster_adapters),
        with this gateway's own loads and unloads of the last moments (RecentLoRAChanges)."""
        instances = []
        for tier in ("decode", "prefill"):
            instances += await self.registry.list_instances(tier, self.model_id)
        return self.lora_changes.apply(cluster_adapters(instances))

    async def adapter(self, name: str) -> ClusterAdapter:
        """The adapter loaded as name. UnknownLoRAError naming it when no live instance has it."""
        adapter = (await self.adapters()).get(name)
        if adapter is None:
            raise UnknownLoRAError(f"the model {name!r} does not exist: no live instance has a LoRA adapter of that "
                                   "name loaded")
        return adapter

    def _session_load(self, instance: InstanceInfo) -> int:
        """An instance's load in tokens, for session affinity's bound: its queue, and for a decode DECODE_LOAD_TOKENS
        per request it serves or holds."""
        requests = instance.num_running + instance.num_waiting if instance.tier == "decode" else 0
        return self._queued_tokens(instance) + DECODE_LOAD_TOKENS * requests

    async def _route(self, prompt_ids: list[int], roomy: list[InstanceInfo], prefills: list[InstanceInfo],
                     cache_salt: str | None, local: bool, plan: AdapterPlan | None = None) -> Route:
        """route's cost model over the candidate decodes (roomy) and prefills; plan: the request's adapter."""
        if self.policy == "round-robin":
            decode = self._turn("decode", roomy)
            if not prefills:  # (none left, or none serves the request's adapter with the cluster's files)
                return Route(decode, None, explanation=["round-robin", f"-> decode {decode.instance_id} computes the "
                             f"prompt itself: {_no_prefill(plan)}"], reason="decode_local")  # fmt: skip
            return Route(decode, self._turn("prefill", self._paired(decode, prefills)),
                         explanation=["round-robin"], reason="round_robin")  # fmt: skip
        bs = self.contract.block_size
        hashes = hash_request_blocks(prompt_ids[: (len(prompt_ids) - 1) // bs * bs], self.contract, cache_salt,
                                     variant=self.kv_variant(len(prompt_ids)),
                                     lora_key=plan.adapter.key if plan else None)
        tiers, hinted = await self._cached_tokens(hashes, prefills + roomy, pool_only={d.instance_id for d in roomy})
        cached = {iid: sum(held.values()) for iid, held in tiers.items()}
        n = len(prompt_ids)
        # (what loading the request's adapter costs each candidate, in tokens: lora_routing.py)
        lora_cost = (plan.costs(roomy) | plan.costs(prefills)) if plan else dict.fromkeys(cached, 0.0)

        def lora_note(i: InstanceInfo) -> str:
            return plan.explain(i, lora_cost[i.instance_id]) if plan else ""

        def decode_score(d: InstanceInfo) -> float:
            requests = d.num_running + d.num_waiting
            return cached[d.instance_id] - DECODE_LOAD_TOKENS * requests - lora_cost[d.instance_id]

        def prefill_cost(p: InstanceInfo) -> float:
            return (p.num_queued_tokens + n - cached[p.instance_id] + self._load_tokens(p, tiers[p.instance_id])
                    + lora_cost[p.instance_id])

        def prefill_order(p: InstanceInfo) -> tuple[float, int]:  # (ties: the one holding more in its pool)
            return prefill_cost(p), -tiers[p.instance_id]["pool"]

        def routed(i: InstanceInfo) -> str:
            return f" ({hinted[i.instance_id]} routed there, not yet indexed)" if hinted.get(i.instance_id) else ""

        explanation = [f"decode {d.instance_id}: {cached[d.instance_id]} cached{routed(d)}, "
                       f"{d.num_running + d.num_waiting} requests{lora_note(d)} -> {decode_score(d):.0f}"
                       for d in roomy]  # fmt: skip
        decode = self._turn("decode", _best(roomy, decode_score, max))
        uncached = n - cached[decode.instance_id]
        if local and not any(p.can_send_kv_to(decode) for p in prefills):
            why = _no_prefill(plan) if not prefills else (
                f"no prefill shares its KV format ({decode.kv_dtype}, blocks of {decode.block_size}) and knows its "
                f"{decode.tensor_parallel_size} ranks")  # fmt: skip
            explanation.append(f"-> decode {decode.instance_id} computes the prompt itself: {why}")
            self._add_queued(decode, uncached)
            return Route(decode, None, 0, cached[decode.instance_id], explanation, reason="decode_local")
        prefills = self._paired(decode, prefills)
        if local and uncached <= self.local_prefill_tokens:
            explanation.append(f"-> decode {decode.instance_id} computes the {uncached} uncached tokens itself "
                               f"(<= {self.local_prefill_tokens})")
            self._add_queued(decode, uncached)
            return Route(decode, None, 0, cached[decode.instance_id], explanation, reason="decode_local")
        explanation += [f"prefill {p.instance_id}: {p.num_queued_tokens} queued + {n - cached[p.instance_id]} "
                        f"to compute{routed(p)}{self._explain_tiers(p, tiers[p.instance_id])}{lora_note(p)} -> "
                        f"{prefill_cost(p):.0f}" for p in prefills]  # fmt: skip
        prefill = self._turn("prefill", _best(prefills, prefill_order, min))
        if local and decode.tokens_per_s and prefill.tokens_per_s:
            waiting = 1 + decode.num_running  # (the requests a local prefill holds up: this one and the running)
            local_s = (self._queued_tokens(decode) + uncached) / decode.tokens_per_s * waiting
            remote_s = prefill_cost(prefill) / prefill.tokens_per_s
            explanation.append(f"measured: on decode {local_s * 1e3:.0f} ms x request ({uncached} tokens at "
                               f"{decode.tokens_per_s:.0f}/s, {waiting} waiting), on prefill {remote_s * 1e3:.0f} "
                               f"ms ({prefill_cost(prefill):.0f} tokens at {prefill.tokens_per_s:.0f}/s)")
            if local_s < remote_s:
                explanation.append(f"-> decode {decode.instance_id} computes the {uncached} uncached tokens itself "
                                   "(cheaper than the prefill tier by measured cost)")
                self._add_queued(decode, uncached)
                return Route(decode, None, 0, cached[decode.instance_id], explanation, reason="decode_local_cost")
        self._remember(prefill, hashes)
        explanation.append(f"-> prefill {prefill.instance_id}, decode {decode.instance_id}")
        return Route(decode, prefill, cached[prefill.instance_id], cached[decode.instance_id], explanation,
                     prefill_cached_tiers=tiers[prefill.instance_id])

    @traced("route")
    async def route_prefill(self, prompt_ids: list[int], skip: set[str] = frozenset()) -> InstanceInfo:
        """Pick a prefill for prefill-only work (an embedding's input; no decode takes part), by route's prefill
        rule: the fewest tokens to compute before it, its queue plus the prompt minus its cached leading run (or
        round-robin). NoInstanceError when no live prefill is left outside skip."""
        prefills = await self.instances("prefill", skip)
        if self.policy == "round-robin":
            return self._turn("prefill", prefills)
        bs = self.contract.block_size
        hashes = hash_request_blocks(prompt_ids[: (len(prompt_ids) - 1) // bs * bs], self.contract, None,
                                     variant=self.kv_variant(len(prompt_ids)))
        tiers, _ = await self._cached_tokens(hashes, prefills)
        cached = {iid: sum(held.values()) for iid, held in tiers.items()}
        prefill = self._turn("prefill", _best(prefills, lambda p: (
            self._queued_tokens(p) + len(prompt_ids) - cached[p.instance_id] + self._load_tokens(
                p, tiers[p.instance_id]), -tiers[p.instance_id]["pool"]), min))  # fmt: skip
        self._remember(prefill, hashes)
        self._add_queued(prefill, len(prompt_ids) - cached[prefill.instance_id])
        return prefill

    def _paired(self, decode: InstanceInfo, prefills: list[InstanceInfo]) -> list[InstanceInfo]:
        """The prefills whose KV the decode can take (InstanceInfo.can_send_kv_to), logged once per prefill that
        cannot. NoInstanceError when there is none."""
        paired = [p for p in prefills if p.can_send_kv_to(decode)]
        for p in prefills:
            if p not in paired and (p.instance_id, decode.instance_id) not in self._unpaired_logged:
                self._unpaired_logged.add((p.instance_id, decode.instance_id))
                log.warning("prefill %s (KV %s, blocks of %d) cannot send KV to decode %s (KV %s, blocks of %d): not "
                            "paired (tensor-parallel ranks: %d and %d, the decode's with %d KV endpoints)",
                            p.instance_id, p.kv_dtype, p.block_size, decode.instance_id, decode.kv_dtype,
                            decode.block_size, p.tensor_parallel_size, decode.tensor_parallel_size,
                            len(decode.kv_endpoints))  # fmt: skip
        if not paired:
            raise NoInstanceError(f"no live prefill shares decode {decode.instance_id}'s KV format ({decode.kv_dtype},"
                                  f" blocks of {decode.block_size}) and knows its {decode.tensor_parallel_size} ranks: "
                                  "start every engine with the same --kv-dtype and --block-size (and, with tensor "
                                  "parallelism, of this version)")  # fmt: skip
        return paired

    def _load_tokens(self, instance: InstanceInfo, held: dict[str, int]) -> float:
        """What bringing the cached tokens held in its host and disk tiers back into its pool costs the instance,
        in tokens it computes meanwhile: blocks x its measured seconds per block of that tier x its measured rate.
        0 before both are measured."""
        seconds = sum(held[t] / self.contract.block_size * instance.kv_tier_load_s.get(t, 0.0) for t in KV_TIERS[1:])
        return seconds * instance.tokens_per_s

    def _explain_tiers(self, instance: InstanceInfo, held: dict[str, int]) -> str:
        """The decision log's account of a candidate's cached tokens below its pool, and what loading them costs."""
        below = [f"{held[t]} in its {t} tier ({instance.kv_tier_load_s.get(t, 0.0) * 1e3:.2f} ms/block)"
                 for t in KV_TIERS[1:] if held[t]]  # fmt: skip
        if not below:
            return ""
        return f", of the cached {', '.join(below)}: +{self._load_tokens(instance, held):.0f} to load"

    def _queued_tokens(self, instance: InstanceInfo) -> int:
        """Its record's queue plus the prompt tokens it was given to compute in the last QUEUE_HINT_S (which the
        record may not show yet: a burst of prompts must not all see the same empty queue)."""
        key, now = (instance.instance_id, instance.incarnation), time.monotonic()
        recent = [(until, tokens) for until, tokens in self._queued.get(key, ()) if until > now]
        if recent:
            self._queued[key] = recent
        else:
            self._queued.pop(key, None)
        return instance.num_queued_tokens + sum(tokens for _, tokens in recent)

    def _add_queued(self, instance: InstanceInfo, tokens: int) -> None:
        key = (instance.instance_id, instance.incarnation)
        self._queued.setdefault(key, []).append((time.monotonic() + QUEUE_HINT_S, tokens))

    async def _cached_tokens(self, hashes: list[BlockHash], candidates: list[InstanceInfo],
                             pool_only: set[str] = frozenset()) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """({instance id: {tier: leading prompt tokens it holds there}} (the run in any tier, each block at the
        fastest tier holding it; pool_only: instances whose pool alone counts), {instance id: of those, tokens
        known only from routing, not yet from the index (counted as in the pool)}), from one index lookup and the
        routing hints; 0 for instances whose contract differs and for all while Redis cannot answer."""
        cached = {c.instance_id: dict.fromkeys(KV_TIERS, 0) for c in candidates}
        indexed = {c.instance_id: c.incarnation for c in candidates if self._same_contract(c)}
        if self.index is None or not indexed or self._index_down:
            return cached, {}
        try:
            runs = await self.index.tiered_prefixes(hashes, indexed, dict.fromkeys(pool_only, KV_TIERS[:1]))
        except IndexUnavailableError as e:
            log.warning("prefix index unavailable, routing on load alone until it answers: %s", e)
            self._index_down = True
            self._probe = asyncio.ensure_future(self._probe_index())
            return cached, {}
        hinted, bs = {}, self.contract.block_size
        for c in candidates:
            if c.instance_id in indexed:
                run = runs[c.instance_id]
                num_hinted = max(0, self._routed_blocks(c, hashes) - sum(run.values()))
                hinted[c.instance_id] = num_hinted * bs
                cached[c.instance_id] = {t: (n + (num_hinted if t == KV_TIERS[0] else 0)) * bs for t, n in run.items()}
        return cached, hinted

    async def _probe_index(self) -> None:
        """While the index is down, no request waits for it: this asks it every INDEX_PROBE_S until it answers."""
        while True:
            await asyncio.sleep(INDEX_PROBE_S)
            try:
                await self.index.ping()
            except IndexUnavailableError:
                continue
            log.info("prefix index answers again: cache-aware routing resumed")
            self._index_down = False
            return

    def _remember(self, instance: InstanceInfo, hashes: list[BlockHash]) -> None:
        """The prompt's blocks go to prefill instance: count them as held there for ROUTED_HINT_S."""
        if not hashes or self.index is None or not self._same_contract(instance):
            return
        entries = self._routed.setdefault((instance.instance_id, instance.incarnation), OrderedDict())
        expires = time.monotonic() + ROUTED_HINT_S
        for h in hashes:
            entries[h] = expires
            entries.move_to_end(h)

    def _routed_blocks(self, instance: InstanceInfo, hashes: list[BlockHash]) -> int:
        """Leading blocks of hashes routed to instance within ROUTED_HINT_S (expired hints are dropped)."""
        key = (instance.instance_id, instance.incarnation)
        entries = self._routed.get(key)
        now = time.monotonic()
        while entries and next(iter(entries.values())) < now:
            entries.popitem(last=False)
        if not entries:
            self._routed.pop(key, None)
            return 0
        num = 0
        for h in hashes:
            if h not in entries:
                break
            num += 1
        return num

    def _same_contract(self, instance: InstanceInfo) -> bool:
        if instance.hash_contract is None:
            return False  # prefix caching off there
        if instance.hash_contract == self.contract.to_dict():
            return True
        if instance.instance_id not in self._mismatch_logged:
            self._mismatch_logged.add(instance.instance_id)
            log.warning("instance %s has hash contract %s, the gateway %s: its prefix cache is not used for "
                        "routing (start both with the same --block-size and --kv-dtype)", instance.instance_id,
                        instance.hash_contract, self.contract.to_dict())  # fmt: skip
        return False

    def _turn(self, tier: str, candidates: list[InstanceInfo]) -> InstanceInfo:
        return candidates[next(self._turns[tier]) % len(candidates)]

    async def cleanup_index(self) -> None:
        """Drop index entries of incarnations no longer registered (call every few seconds)."""
        if self.index is None:
            return
        live = {}
        for tier in ("prefill", "decode"):
            live.update({i.instance_id: i.incarnation for i in await self.registry.list_instances(tier)})
        for key in [k for k in self._routed if live.get(k[0]) != k[1]]:
            del self._routed[key]
        now = time.monotonic()
        self._down = {i: until for i, until in self._down.items() if until > now}
        self.lora_changes.expire()
        self._queued = {key: hints for key, hints in self._queued.items() if live.get(key[0]) == key[1]}
        self.sessions.expire()
        try:
            await self.index.cleanup(live)
        except IndexUnavailableError:
            pass  # _cached_tokens reports the outage


def _no_prefill(plan: AdapterPlan | None) -> str:
    """Why a request has no prefill to go to: its adapter's (plan), or none is left."""
    return plan.no_prefill() if plan is not None else ("no live prefill is left (none is registered, or each one is "
                                                       "marked down or failed for this request)")


def _best(candidates: list[InstanceInfo], key, pick) -> list[InstanceInfo]:
    """The candidates whose key equals the best (pick: min or max) of all."""
    best = pick(key(c) for c in candidates)
    return [c for c in candidates if key(c) == best]
