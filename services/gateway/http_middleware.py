"""ASGI middleware of the OpenAI-compatible HTTP API (plain ASGI, not BaseHTTPMiddleware, which would stand
between a stream and its client's disconnect): the body size limit and the API keys."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from tandem.services.gateway.openai_protocol import APIError
from tandem.services.security import APIKeys
from tandem.services.server import PUBLIC_MAX_RECEIVE_BYTES


class BodyLimitMiddleware:
    """ASGI middleware: a request body over PUBLIC_MAX_RECEIVE_BYTES (the public gRPC port's message limit) gets
    413 before any of it is parsed; the body is read here (at most that much) and replayed to the app."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        size, chunks, more = int(length) if length.isdigit() else 0, [], True
        while more and size <= PUBLIC_MAX_RECEIVE_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # (nobody to answer)
            chunks.append(message.get("body", b""))
            size = max(size, sum(map(len, chunks)))
            more = message.get("more_body", False)
        if size > PUBLIC_MAX_RECEIVE_BYTES:
            error = APIError(413, f"the request body has more than {PUBLIC_MAX_RECEIVE_BYTES} bytes, the limit")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # (later reads: the client's disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize")  # the paths APIKeyMiddleware guards (prefixes)


class APIKeyMiddleware:
    """ASGI middleware (not BaseHTTPMiddleware, which would stand between a stream and its disconnect): a request
    to GUARDED_PATHS without "Authorization: Bearer <key>" of api_keys (or Anthropic's "x-api-key: <key>") gets 401 and
    OpenAI's invalid_api_key error."""

    def __init__(self, app, api_keys: APIKeys):
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PATHS) or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:  # (Anthropic's clients send the key as x-api-key)
            key = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-api-key"), None)
            header = None if key is None else f"Bearer {key}"
        refusal = self.api_keys.refusal(header)
        if refusal is None:
            return await self.app(scope, receive, send)
        error = APIError(401, f"{refusal} (the gateway's --api-key)", code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
