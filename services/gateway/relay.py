"""The stream relay of one placed request: the decode's (and the prefill's first-token) messages in, the public
stream out: UTF-8-safe text deltas with their token ids and logprobs (services/gateway/detokenizer.py cuts stop
strings), then a last message with finish_reason, usage and timings."""
from __future__ import annotations

import logging
import time

from tandem.services.client import finish_name
from tandem.services.gateway.detokenizer import TextStream
from tandem.services.gateway.metrics import GatewayMetrics
from tandem.services.gateway.placement import Placement
from tandem.services.gateway.reasoning import split_reasoning
from tandem.services.gateway.tool_parsers import parse
from tandem.services.gateway.request import GatewayRequest
from tandem.v1 import common_pb2, decode_pb2, gateway_pb2

log = logging.getLogger(__name__)


class Relay:
    """One placed request's stream state: push() each decode message, then final() once finish_reason is set.
    metrics: the gateway's, or None when the request is not counted (GatewayRequest.record_metrics)."""

    def __init__(self, request: GatewayRequest, placement: Placement, text: TextStream, arrival_time: float,
                 metrics: GatewayMetrics | None):
        self.request, self.placement, self.text, self.metrics = request, placement, text, metrics
        self.arrival_time = arrival_time  # perf_counter seconds
        prefill_reply = placement.prefill_reply
        # prompt tokens found cached where the prompt was computed: all, and of those, from the host and disk tiers
        self.num_cached_tokens = prefill_reply.num_cached_tokens if prefill_reply else 0
        self.num_cached_tier_tokens = ((prefill_reply.num_cached_tokens_host, prefill_reply.num_cached_tokens_disk)
                                       if prefill_reply else (0, 0))  # fmt: skip
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.migrations: list[str] = []  # "decode A -> decode B (reason)" for each time the request migrated
        self.finish_reason: int | None = None  # common_pb2.FinishReason
        self.last_sent = time.perf_counter()
        self.ttft_ms = (self.last_sent - arrival_time) * 1000
        self.prompt_logprobs = prefill_reply.prompt_logprobs if prefill_reply else ()  # (sent with the first message)
        if prefill_reply is not None and metrics is not None:
            metrics.queue_time.observe(prefill_reply.queue_ms / 1000)

    def push(self, reply: decode_pb2.DecodeResponse) -> gateway_pb2.GenerateResponse | None:
        """The public message for reply (None when it carries nothing to send: a token held back for a possible
        stop string); sets finish_reason when the request ends with it."""
        if reply.HasField("finish_reason"):
            self.finish_reason = reply.finish_reason
        if self.placement.prefill_reply is None and not self.migrations:  # (usage counts the first placement's)
            self.num_cached_tokens = reply.num_cached_tokens
            self.num_cached_tier_tokens = (reply.num_cached_tokens_host, reply.num_cached_tokens_disk)
        text = self.text
        num_before = len(text.token_ids)
        delta = text.push(list(reply.token_ids))
        new_ids = text.token_ids[num_before:]  # (none past a stop string)
        self.num_draft_tokens += reply.num_draft_tokens
        self.num_accepted_tokens += min(reply.num_accepted_tokens, len(new_ids))  # (those sent)
        if self.metrics is not None and new_ids and len(text.token_ids) > len(new_ids):  # (the first's: the TTFT)
            now = time.perf_counter()
            self.metrics.observe_tokens(len(new_ids), now - self.last_sent)
            self.last_sent = now
        msg = None
        if new_ids or self.prompt_logprobs:
            msg = gateway_pb2.GenerateResponse(request_id=self.request.request_id, text=delta, token_ids=new_ids,
                                               logprobs=reply.logprobs[: len(new_ids)],
                                               prompt_logprobs=self.prompt_logprobs)  # fmt: skip
            self.prompt_logprobs = ()
        if text.stopped:
            self.finish_reason = common_pb2.FINISH_REASON_STOP
        return msg

    def _answer_parts(self) -> tuple[list[gateway_pb2.ToolCall], str]:
        """The whole text's tool calls and reasoning, per the request's parsers (finish_reason becomes
        TOOL_CALLS when an answer that stopped holds calls)."""
        request, text = self.request, self.text.text
        reasoning = ""
        if request.reasoning_parser is not None:
            reasoning, text = split_reasoning(request.reasoning_parser, text)
            reasoning = reasoning or ""
        if request.tool_parser is None:
            return [], reasoning
        _, calls = parse(request.tool_parser, text)
        if calls and all(c.complete for c in calls) and self.finish_reason == common_pb2.FINISH_REASON_STOP:
            self.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        return [gateway_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls], reasoning

    def resume(self, placement: Placement, reason: str) -> None:
        """Go on from placement, the request placed again with its output so far after its decode failed for
        reason (pipeline.py): its first message is the next token."""
        self.migrations.append(f"decode {self.placement.route.decode.instance_id} -> "
                               f"{placement.route.decode.instance_id} ({reason})")
        self.placement = placement

    def final(self) -> gateway_pb2.GenerateResponse:
        """The last message: the rest of the text, finish_reason, usage and timings (counted in the metrics, and
        logged)."""
        request, route, prefill_reply = self.request, self.placement.route, self.placement.prefill_reply
        num_prompt, num_generated = request.num_prompt_tokens, len(self.text.token_ids)
        rest = self.text.finish()
        tool_calls, reasoning = self._answer_parts()
        e2e_ms = (time.perf_counter() - self.arrival_time) * 1000
        if self.metrics is not None:
            self.metrics.observe_finished(finish_name(self.finish_reason), num_prompt, self.num_cached_tokens,
                                          num_generated, self.ttft_ms / 1000, e2e_ms / 1000)  # fmt: skip
        where = (f"prefill {prefill_reply.prefill_ms:.0f} ms on {route.prefill.instance_id}, "
                 f"{prefill_reply.num_blocks_sent} KV blocks sent" if prefill_reply else "prompt computed on the decode")
        migrated = f"; migrated: {', '.join(self.migrations)}" if self.migrations else ""
        log.info("request %s: %d prompt (%d cached) + %d completion tokens, %s, TTFT %.0f ms (%s), E2E %.0f ms "
                 "(decode %s%s)", request.request_id, num_prompt, self.num_cached_tokens, num_generated,
                 common_pb2.FinishReason.Name(self.finish_reason), self.ttft_ms, where, e2e_ms,
                 route.decode.instance_id, migrated)  # fmt: skip
        return gateway_pb2.GenerateResponse(
            request_id=request.request_id,
            text=rest,
            finish_reason=self.finish_reason,
            tool_calls=tool_calls,
            reasoning_content=reasoning,
            stop_string=self.text.stop_string or "",
            usage=gateway_pb2.Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                                    cached_tokens=self.num_cached_tokens, num_draft_tokens=self.num_draft_tokens,
                                    num_accepted_tokens=self.num_accepted_tokens,
                                    cached_tokens_host=self.num_cached_tier_tokens[0],
                                    cached_tokens_disk=self.num_cached_tier_tokens[1]),
            timings=gateway_pb2.Timings(ttft_ms=self.ttft_ms, e2e_ms=e2e_ms),
        )
