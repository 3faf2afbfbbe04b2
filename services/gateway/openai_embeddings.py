"""POST /v1/embeddings, POST /tokenize and POST /detokenize, with vLLM's request and response shapes (its
OpenAIServingEmbedding and OpenAIServingTokenization).

Embeddings are prefill-only work (services/gateway/embeddings.py): each input is computed on one prefill as a
pooling request, never decoded. The pooling method is last-token pooling: the model's final hidden state (after its
final norm) at the input's last token, L2-normalized (vLLM's default for decoder models: LAST with normalize, what
e5-mistral and Qwen3-Embedding use). Text inputs are tokenized as vLLM does, with the tokenizer's special tokens
(add_special_tokens, default true). Limits: MAX_EMBEDDING_INPUTS inputs per request and the model's context
(max_model_len) tokens per input; beyond them, a 400 naming input.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tandem.services.gateway.embeddings import Embedder
from tandem.services.gateway.lora_adapters import adapter_named
from tandem.services.gateway.openai_errors import APIError, api_error
from tandem.services.gateway.openai_protocol import (Body, ChatCompletionRequest, ChatMessage, chat_messages,
                                                     check_int32)
from tandem.services.gateway.openai_serving import ROLE_ALIASES, ClientDisconnected, unless_disconnected
from tandem.services.gateway.pipeline import GatewayPipeline
from tandem.services.gateway.tool_calls import check_tools, render_messages
from tandem.services.gateway.validation import MAX_CHARS_PER_TOKEN, check_roles
from tandem.shared.errors import InvalidRequestError
from tandem.shared.request import check_token_ids

log = logging.getLogger(__name__)
MAX_EMBEDDING_INPUTS = 64  # inputs in one /v1/embeddings request (as MAX_PROMPTS for completions)


# -- request bodies ------------------------------------------------------------------------------------------
class EmbeddingRequest(Body):
    """OpenAI's embeddings body (API reference, "Create embeddings") with vLLM's add_special_tokens and priority.
    Other fields are refused by name."""

    model_config = ConfigDict(extra="allow")
    input: Any  # a string, a list of strings, a list of token ids, or a list of token id lists (embedding_inputs)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's hidden size: no Matryoshka truncation
    user: str | None = None  # ignored
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text input
    priority: int = 0  # vLLM's: the engines' scheduling priority, lower first


class TokenizeRequest(Body):
    """vLLM's /tokenize body: prompt (TokenizeCompletionRequest) or messages (TokenizeChatRequest)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages: end with the template's assistant header
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's own)
    return_token_strs: bool = False  # also each token as the tokenizer's string (convert_ids_to_tokens)


class DetokenizeRequest(Body):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class OpenAIEmbeddings:
    """The routes over a GatewayPipeline (its tokenizer, model config, admission queue, router and channels);
    model_name: the id requests may name; instance_id: the gateway's."""

    def __init__(self, pipeline: GatewayPipeline, model_name: str, instance_id: str):
        self.pipeline, self.model_name, self.instance_id = pipeline, model_name, instance_id
        self.embedder = Embedder(pipeline.placer.router, pipeline.placer.channels)

    def router(self) -> APIRouter:
        """The routes, for FastAPI.include_router."""
        router = APIRouter()
        router.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return router

    async def _check_body(self, body: BaseModel) -> None:
        """400 naming model for a LoRA adapter (served by the generating endpoints only), 404 for another model, 400
        naming the first field this server does not take."""
        if adapter_named(body.model, self.model_name) is not None:
            if body.model in await self.pipeline.placer.router.adapters():
                raise APIError(400, f"the model {body.model!r} is a LoRA adapter: adapters are served by the "
                                    "generating endpoints only; this endpoint takes the base model "
                                    f"{self.model_name!r}", "model")  # fmt: skip
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")  # fmt: skip
        extra = sorted(body.model_extra or ())
        if extra:
            raise APIError(400, f"{extra[0]} is not supported by this server", extra[0])

    # -- /v1/embeddings ------------------------------------------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, request: Request):
        """POST /v1/embeddings: one embedding per input (the module's docstring), as floats or base64 (the
        little-endian float32 bytes, as OpenAI's)."""
        await self._check_body(body)
        hidden_size = self.pipeline.model_config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden_size:
            raise APIError(400, f"dimensions {body.dimensions}: this model's embeddings have {hidden_size}; "
                                "truncating them (Matryoshka) is not supported", "dimensions")  # fmt: skip
        check_int32("priority", body.priority)
        inputs = await asyncio.to_thread(self._tokenize_inputs, embedding_inputs(body.input), body.add_special_tokens)
        response_id = "embd-" + uuid.uuid4().hex

        async def run():  # (holding one of the gateway's admission slots: OverloadedError when none comes in time)
            async with self.pipeline.admission.slot(body.priority):
                return await self.embedder.embed(response_id, inputs, body.priority)

        try:
            reply = await unless_disconnected(request, run())
        except ClientDisconnected:
            log.info("%s: the client disconnected; request aborted", response_id)
            self.pipeline.metrics.observe_error("CANCELLED")
            return Response(status_code=499)
        except Exception as e:
            raise api_error(e, self.instance_id) from None
        data = []
        for i, embedding in enumerate(reply.embeddings):
            values = np.asarray(embedding.values, dtype="<f4")
            encoded = base64.b64encode(values.tobytes()).decode() if body.encoding_format == "base64" \
                else values.tolist()  # fmt: skip
            data.append({"object": "embedding", "index": i, "embedding": encoded})
        num_tokens = sum(map(len, inputs))
        return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()),
                             "model": self.model_name, "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})  # fmt: skip

    def _tokenize_inputs(self, inputs: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        """Each input as token ids, within the model's context and vocabulary. APIError 400 naming input."""
        config, tokenizer = self.pipeline.model_config, self.pipeline.tokenizer
        max_len, ids = config.max_model_len, []
        for i, x in enumerate(inputs):
            where = f"input[{i}]" if len(inputs) > 1 else "input"
            if isinstance(x, str):
                if len(x) > MAX_CHARS_PER_TOKEN * max_len:  # (a cheap bound before tokenizing)
                    raise APIError(400, f"{where} has {len(x)} characters; at most "
                                        f"{MAX_CHARS_PER_TOKEN * max_len} fit the model's context", "input")
                x = tokenizer(x, add_special_tokens=add_special_tokens).input_ids
                if not x:
                    raise APIError(400, f"{where} has no tokens", "input")
            else:
                try:
                    check_token_ids(f"{where} token ids", x, config.vocab_size)
                except InvalidRequestError as e:
                    raise APIError(400, str(e), "input") from None
            if len(x) > max_len:
                raise APIError(400, f"{where} has {len(x)} tokens; at most {max_len} (the model's context)", "input")
            ids.append(x)
        return ids

    # -- /tokenize, /detokenize ----------------------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest):
        """POST /tokenize: a prompt or chat messages (rendered with the chat template, as the chat API does) as
        token ids: {"count", "max_model_len", "tokens"} (and "token_strs" when asked)."""
        await self._check_body(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        tokens = await asyncio.to_thread(self._tokenize, body)
        answer = {"count": len(tokens), "max_model_len": self.pipeline.model_config.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = self.pipeline.tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse(answer)

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        tokenizer, max_len = self.pipeline.tokenizer, self.pipeline.model_config.max_model_len
        param = "prompt" if body.prompt is not None else "messages"
        if body.prompt is not None:
            text, special = body.prompt, True if body.add_special_tokens is None else body.add_special_tokens
        else:
            try:
                chat = chat_messages(ChatCompletionRequest(messages=body.messages), ROLE_ALIASES)
                check_roles(chat)
                messages, extra = render_messages(chat, check_tools(chat), tokenizer)
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                     tokenize=False, **extra)  # fmt: skip
            except (InvalidRequestError, ValueError) as e:  # (a template may refuse the turns' order)
                raise APIError(400, f"messages: {e}", "messages") from None
            special = bool(body.add_special_tokens)
        if len(text) > MAX_CHARS_PER_TOKEN * max_len:
            raise APIError(400, f"{param} has {len(text)} characters; at most {MAX_CHARS_PER_TOKEN * max_len}", param)
        return tokenizer(text, add_special_tokens=special).input_ids

    async def detokenize(self, body: DetokenizeRequest):
        """POST /detokenize: token ids as text ({"prompt"}), special tokens included (as vLLM's)."""
        await self._check_body(body)
        try:
            check_token_ids("tokens", body.tokens, self.pipeline.model_config.vocab_size)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "tokens") from None
        if len(body.tokens) > self.pipeline.model_config.max_model_len * MAX_CHARS_PER_TOKEN:
            raise APIError(400, f"tokens has {len(body.tokens)} ids; at most the model's context times "
                                f"{MAX_CHARS_PER_TOKEN}", "tokens")  # fmt: skip
        return JSONResponse({"prompt": await asyncio.to_thread(self.pipeline.tokenizer.decode, body.tokens)})


def embedding_inputs(value) -> list[str | list[int]]:
    """The embeddings API's input field as a list of inputs: a string, a list of strings, a list of token ids
    (one input) or a list of token id lists, at most MAX_EMBEDDING_INPUTS. APIError 400 naming input for
    anything else or an empty input."""
    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str) or (is_ids(value) and value):
        value = [value]
    if not isinstance(value, list) or not value or not (all(isinstance(x, str) for x in value)
                                                        or all(is_ids(x) for x in value)):  # fmt: skip
        raise APIError(400, "input must be a non-empty string, list of strings, list of token ids, or list of token "
                            "id lists", "input")  # fmt: skip
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input has {len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} per request", "input")
    for i, x in enumerate(value):
        if not x:
            raise APIError(400, f"input[{i}] is empty" if len(value) > 1 else "input is empty", "input")
    return value

