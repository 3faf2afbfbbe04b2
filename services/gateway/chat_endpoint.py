"""What the HTTP endpoints that are not OpenAI's chat completions share (responses_api.py, anthropic_api.py): each
translates its body into the gRPC API's chat request, then starts it here through the gateway's pipeline (the
same tokenizer, chat template, tool calling and validation) and reads the completion's messages."""
from __future__ import annotations

from pydantic import BaseModel

from tandem.services.gateway.openai_errors import api_error
from tandem.services.gateway.openai_protocol import APIError, param_named
from tandem.services.gateway.openai_responses import ResponseShape
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.request import GatewayRequest
from tandem.shared.errors import InvalidRequestError
from tandem.v1 import gateway_pb2


class ChatEndpoint:
    """One endpoint over a GatewayPipeline; model_name: the id requests may name; instance_id: the gateway's."""

    def __init__(self, pipeline: GatewayPipeline, model_name: str, instance_id: str):
        self.pipeline, self.model_name, self.instance_id = pipeline, model_name, instance_id

    def check_body(self, body: BaseModel, model: str | None, why: dict[str, str] | None = None) -> None:
        """APIError 404 for a model this gateway does not serve, 400 naming the first field of body it does not
        take (its model_extra; why: a reason to add per field)."""
        if model not in (None, "", self.model_name):
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")  # fmt: skip
        extra = sorted(set(body.model_extra or ()))
        if extra:
            raise APIError(400, f"{extra[0]} is not supported by this server{(why or {}).get(extra[0], '')}",
                           extra[0])  # fmt: skip

    async def start(self, grpc_request: gateway_pb2.GenerateRequest, request_id: str,
                    params_named: dict[str, str] | None = None):
        """Tokenize, apply the tool choice (GatewayPipeline.answer_format) and validate; returns (the prompt's
        token count, the ResponseShape of the answer's parsers, the completion's message stream). APIError 400
        naming the field (params_named renames the gRPC API's names to the endpoint's)."""
        try:
            prompt_ids = await self.pipeline.tokenize(grpc_request)
            params, parsers = self.pipeline.answer_format(grpc_request)
            request = await self.pipeline.validate(GatewayRequest(request_id, prompt_ids, params, **parsers))
        except InvalidRequestError as e:
            named = param_named(str(e))
            raise APIError(400, str(e), (params_named or {}).get(named, named)) from None
        return len(prompt_ids), ResponseShape(chat=True, n=1, **parsers), self.pipeline.run(request)

    async def whole(self, stream) -> tuple[str, gateway_pb2.GenerateResponse]:
        """The completion's whole text and its last message; the pipeline's errors as APIError."""
        text, last = "", None
        try:
            async for msg in stream:
                text += msg.text
                last = msg
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        finally:
            await stream.aclose()
        return text, last
