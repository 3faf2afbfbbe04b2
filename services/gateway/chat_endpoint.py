"""What the HTTP endpoints that are not OpenAI's chat completions share (responses_api.py, anthropic_api.py): each
translates its body into the gRPC API's chat request, then starts it here through the gateway's pipeline (the
same tokenizer, chat template, tool calling and validation) and reads the completion's messages."""
from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel

from tandem.services.gateway.lora_adapters import resolve_model
from tandem.services.gateway.openai_errors import api_error
from tandem.services.gateway.openai_errors import APIError, param_named
from tandem.services.gateway.openai_protocol import session_id
from tandem.services.gateway.openai_responses import ResponseShape
from tandem.services.gateway.openai_serving import ClientDisconnected, unless_disconnected
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.request import GatewayRequest
from tandem.shared.errors import InvalidRequestError, UnknownLoRAError
from tandem.v1 import gateway_pb2


class ChatEndpoint:
    """One endpoint over a GatewayPipeline; model_name: the id requests may name; instance_id: the gateway's."""

    def __init__(self, pipeline: GatewayPipeline, model_name: str, instance_id: str):
        self.pipeline, self.model_name, self.instance_id = pipeline, model_name, instance_id

    async def check_body(self, body: BaseModel, model: str | None, why: dict[str, str] | None = None) -> str | None:
        """The LoRA adapter model names (None: the base model). APIError 404 for a model this gateway does not
        serve, 400 naming the first field of body it does not take (its model_extra; why: a reason to add per
        field)."""
        lora_name = await resolve_model(self.pipeline.placer.router, self.model_name, model)
        extra = sorted(set(body.model_extra or ()))
        if extra:
            raise APIError(400, f"{extra[0]} is not supported by this server{(why or {}).get(extra[0], '')}",
                           extra[0])  # fmt: skip
        return lora_name

    async def start(self, grpc_request: gateway_pb2.GenerateRequest, request_id: str, request: Request,
                    params_named: dict[str, str] | None = None, lora_name: str | None = None):
        """Tokenize, apply the tool choice (GatewayPipeline.answer_format) and validate; returns (the prompt's
        token count, the ResponseShape of the answer's parsers, the completion's message stream). APIError 400
        naming the field (params_named renames the gRPC API's names to the endpoint's) or the X-Session-Id header
        of request; 404 naming lora_name (check_body's adapter) when it was unloaded meanwhile."""
        session = session_id(request.headers)
        try:
            prompt_ids = await self.pipeline.tokenize(grpc_request)
            params, parsers = self.pipeline.answer_format(grpc_request)
            validated = await self.pipeline.validate(GatewayRequest(request_id, prompt_ids, params, **parsers,
                                                                    session_id=session, lora_name=lora_name))
        except UnknownLoRAError as e:
            raise APIError(404, str(e), "model", "model_not_found") from None
        except InvalidRequestError as e:
            named = param_named(str(e))
            raise APIError(400, str(e), (params_named or {}).get(named, named)) from None
        return len(prompt_ids), ResponseShape(chat=True, n=1, **parsers), self.pipeline.run(validated)

    async def whole(self, stream, request: Request) -> tuple[str, gateway_pb2.GenerateResponse] | None:
        """The completion's whole text and its last message, or None when the client disconnected first (the
        request is then aborted on both tiers); the pipeline's errors as APIError."""
        async def collect():
            text, last = "", None
            async for msg in stream:
                text += msg.text
                last = msg
            return text, last

        try:
            return await unless_disconnected(request, collect())
        except ClientDisconnected:
            self.pipeline.metrics.observe_error("CANCELLED")
            return None
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        finally:
            await stream.aclose()
