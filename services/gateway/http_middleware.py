"""ASGI middleware of the OpenAI-compatible HTTP API (plain ASGI, not BaseHTTPMiddleware, which would stand
between a stream and its client's disconnect): the body size limit, strings that are not Unicode, and the API
keys."""
from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

from tandem.services.gateway.openai_errors import APIError
from tandem.services.security import APIKeys
from tandem.services.server import PUBLIC_MAX_RECEIVE_BYTES


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's escape of a UTF-16 surrogate, paired or not


def lone_surrogate(body: bytes) -> APIError | None:
    """A 400 naming where the JSON body holds a string with a lone UTF-16 surrogate ("\\ud800", which JSON may
    escape but UTF-8 cannot encode: neither protobuf, the tokenizer nor a log takes it), or None. Bodies without a
    surrogate escape are not parsed here."""
    if not SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None  # (the app refuses what is not JSON, naming where it broke)
    todo = [(value, "")]
    while todo:
        value, path = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for raw_key, item in items:  # (the key as the message shows it: a lone surrogate escaped)
            key = raw_key.encode("utf-8", "backslashreplace").decode() if isinstance(raw_key, str) else raw_key
            where = f"{path}.{key}" if path and isinstance(key, str) else f"{path}[{key}]" if path else str(key)
            for text in (raw_key, item):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        bad = e.object[e.start : e.end].encode("unicode_escape").decode()
                        param = where.split(".")[0].split("[")[0]
                        return APIError(400, f"{where}: not valid Unicode: it holds {bad} (a lone UTF-16 "
                                             "surrogate)", param)  # fmt: skip
            todo.append((item, where))
    return None


class BodyLimitMiddleware:
    """ASGI middleware: a request body over PUBLIC_MAX_RECEIVE_BYTES (the public gRPC port's message limit) gets
    413 before any of it is parsed; the body is read here (at most that much) and replayed to the app, unless it
    holds a lone surrogate (lone_surrogate: 400)."""

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
        if (error := lone_surrogate(body)) is not None:
            return await JSONResponse(error.body(), status_code=400)(scope, receive, send)

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
