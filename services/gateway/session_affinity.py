"""Session affinity: a client's routing key (the HTTP API's X-Session-Id header, GenerateRequest.session_id) and
the gateway's memory of the prefill/decode pair each session's last request used. The router
(services/gateway/router.py) keeps a session's requests on that pair while each instance is live and within the
load bound, and records the pair it chose (docs/prefix-caching.md "Session affinity").

The memory is this gateway's own, as in SGLang's and Dynamo's routers: a map of at most max_sessions entries,
least recently used evicted first, each forgotten ttl_s after its session's last request. With several gateways,
each learns a session's pair on the session's first request through it (a load balancer hashing on the header
keeps a session on one gateway)."""
from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from tandem.services.flags import DEFAULT_SESSION_TTL_S, MAX_SESSIONS
from tandem.shared.cluster_state.registry import InstanceInfo
from tandem.shared.errors import InvalidRequestError

SESSION_HEADER = "X-Session-Id"
MAX_SESSION_ID_CHARS = 256
SESSION_ID_PATTERN = re.compile(r"[!-~]+")  # printable ASCII without spaces: what any client sends in a header


def check_session_id(session_id: str, name: str = "session_id") -> None:
    """InvalidRequestError naming the field (name) unless session_id has 1-MAX_SESSION_ID_CHARS printable ASCII
    characters and no spaces."""
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"{name} has {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}")
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidRequestError(f"{name} must be 1-{MAX_SESSION_ID_CHARS} printable ASCII characters without "
                                  f"spaces, got {session_id!r}")  # fmt: skip


@dataclass(slots=True)
class SessionPin:
    """The pair a session's last request used: (instance id, incarnation) of each; prefill None when only the
    decode computed its prompts so far."""

    decode: tuple[str, str]
    prefill: tuple[str, str] | None
    expires: float  # monotonic seconds


def instance_key(instance: InstanceInfo) -> tuple[str, str]:
    return instance.instance_id, instance.incarnation


class SessionTable:
    """Session id -> SessionPin, LRU-bounded to max_sessions, each entry dropped ttl_s after it was last set."""

    def __init__(self, ttl_s: float = DEFAULT_SESSION_TTL_S, max_sessions: int = MAX_SESSIONS):
        if ttl_s <= 0 or max_sessions <= 0:
            raise ValueError(f"session TTL and table size must be > 0, got {ttl_s} s and {max_sessions}")
        self.ttl_s, self.max_sessions = ttl_s, max_sessions
        self._pins: OrderedDict[str, SessionPin] = OrderedDict()  # least recently set first

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session_id: str) -> SessionPin | None:
        """The session's pin, or None when it is unknown or expired."""
        pin = self._pins.get(session_id)
        if pin is not None and pin.expires <= time.monotonic():
            del self._pins[session_id]
            return None
        return pin

    def remember(self, session_id: str, decode: InstanceInfo, prefill: InstanceInfo | None) -> None:
        """The session's request went to decode (and prefill, None: the decode computed the prompt, in which case
        a prefill the session already used with this decode stays its prefill). Evicts the least recently used
        session past max_sessions."""
        old = self._pins.pop(session_id, None)
        prefill_key = instance_key(prefill) if prefill is not None else None
        if prefill_key is None and old is not None and old.decode == instance_key(decode):
            prefill_key = old.prefill
        self._pins[session_id] = SessionPin(instance_key(decode), prefill_key, time.monotonic() + self.ttl_s)
        while len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)

    def stay(self, session_id: str, decodes: list[InstanceInfo], roomy: list[InstanceInfo],
             paired: list[InstanceInfo], prefills: list[InstanceInfo], skip: set[str], down: dict[str, float],
             load: Callable[[InstanceInfo], int],
             max_load: int) -> tuple[tuple[InstanceInfo, InstanceInfo | None] | None, str]:
        """((decode, prefill or None) the session stays on, or None: the cost model places it; the decision
        log's line saying why), by the rule of services/gateway/router.py's docstring: decodes, the live ones;
        roomy, those with room for the request; paired, those a prefill shares a KV format with; skip, instances
        this request must not use; down, instance id -> until when routing avoids it; load, an instance's load in
        tokens; max_load, the bound above its tier's least loaded (--session-affinity-max-load)."""
        pin = self.get(session_id)
        if pin is None:
            return None, f"session {session_id}: new here, placed by the cost model"
        now, kept, loads = time.monotonic(), {}, []
        for tier, key, candidates in (("decode", pin.decode, paired), ("prefill", pin.prefill, prefills)):
            if key is None:
                kept[tier] = None
                continue
            moves = f"session {session_id}: moves from {tier} {key[0]}, which"
            if key[0] in skip:
                return None, f"{moves} failed this request"
            if down.get(key[0], 0) > now:
                return None, f"{moves} is marked down"
            found = next((i for i in candidates if (i.instance_id, i.incarnation) == key), None)
            if found is None:
                if tier == "decode" and any((d.instance_id, d.incarnation) == key for d in decodes):
                    why = "has no room for the request" if key[0] not in {d.instance_id for d in roomy} else (
                        "shares no prefill's KV format")  # fmt: skip
                    return None, f"{moves} {why}"
                return None, f"{moves} is gone or restarted"
            excess = load(found) - min(load(c) for c in candidates)
            if excess > max_load:
                return None, (f"{moves} is {excess} tokens above the least loaded {tier} "
                              f"(> {max_load}, --session-affinity-max-load)")
            kept[tier] = found
            loads.append(f"{tier} {found.instance_id} +{excess}")
        decode, prefill = kept["decode"], kept["prefill"]
        if prefill is not None and not prefill.can_send_kv_to(decode):
            return None, f"session {session_id}: moves: prefill {prefill.instance_id} no longer shares its KV format"
        return (decode, prefill), (f"session {session_id}: stays ({', '.join(loads)} tokens above the least loaded, "
                                   f"<= {max_load})")

    def expire(self) -> None:
        """Drop expired sessions (the router's periodic cleanup)."""
        now = time.monotonic()
        while self._pins and next(iter(self._pins.values())).expires <= now:  # (oldest first: one TTL for all)
            self._pins.popitem(last=False)
