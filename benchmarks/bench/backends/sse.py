"""Server-sent events from an HTTP POST: the streamed responses of llama-server and of OpenAI-compatible servers.

A stream is "data: {json}" lines (blank lines between events); OpenAI's API ends it with "data: [DONE]";
llama-server reports a failure after the stream began as an "error: ..." line. Read with http.client in the
calling thread (the backends run it in worker threads), so each event is seen the moment its line arrives.
"""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit


def connect(url: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to the host of an http:// or https:// URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=timeout_s)


def post_events(url: str, body: dict, timeout_s: float) -> Iterator[dict]:
    """POST body as JSON to url and yield each event's JSON object as its line arrives, until [DONE] or the end
    of the response. RuntimeError on an HTTP status other than 200 (with the start of the answer) or an
    "error: " line; timeout_s bounds each read."""
    parts = urlsplit(url)
    connection = connect(url, timeout_s)
    try:
        connection.request("POST", parts.path or "/", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read(500).decode(errors='replace')}")
        for line in response:  # http.client undoes the chunked transfer encoding
            if line.startswith(b"error: "):
                raise RuntimeError(f"error event: {line[len(b'error: '):].decode(errors='replace').strip()}")
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    finally:
        connection.close()


def get(url: str, timeout_s: float = 2) -> bytes | None:
    """The body of url's answer to a GET; None unless it answers 200 (or when it does not answer: a server that is
    still starting)."""
    parts = urlsplit(url)
    connection = connect(url, timeout_s)
    try:
        connection.request("GET", parts.path or "/")
        response = connection.getresponse()
        body = response.read()
        return body if response.status == 200 else None
    except OSError:
        return None
    finally:
        connection.close()
