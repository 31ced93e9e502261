"""ASGI middleware for vLLM's OpenAI server: ``--middleware kvcmas.serve.http.KvcmasMiddleware``.

vLLM passes ``kv_transfer_params`` through to the engine unchecked, and the connector's
scheduler side must never raise (it would stop the engine), so malformed ``kvcmas`` params are
refused here with HTTP 400 naming the field. The middleware also salts each kvcmas request by
its (namespace, session) (a client's own salt is kept inside it), so the KV a connector loads
enters vLLM's prefix cache only under that session's salt; a client salt with the reserved
``kvcmas:`` prefix is refused (it would reach a session's approximate KV). It serves
``GET /kvcmas/stats`` from the JSON file the connector's worker writes (the engine runs in
another process).
No vllm import.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvcmas.serve.params import (
    SALT_PREFIX,
    STATS_FILE_ENV,
    KvcmasParamsError,
    parse_kvcmas_params,
    session_cache_salt,
)

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


async def _send_json(send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    # The shape of vLLM's (and OpenAI's) error body, so clients raise their usual exception.
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class KvcmasMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "")
        if path == "/kvcmas/stats" and method == "GET":
            return await self._stats(send)
        if method != "POST" or path not in _GENERATION_PATHS:
            return await self.app(scope, receive, send)

        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away before sending a body
                return await self.app(scope, _replay(b"", receive, first=message), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            request = json.loads(body)
        except ValueError:
            request = None  # vLLM answers malformed JSON itself
        if isinstance(request, dict):
            salt = request.get("cache_salt")
            if isinstance(salt, str) and salt.startswith(SALT_PREFIX):
                # A forged session salt would read that session's approximate KV.
                message = (f"cache_salt: the prefix {SALT_PREFIX!r} is reserved for kvcmas "
                           "sessions; tag the request with kv_transfer_params.kvcmas instead")
                return await _send_json(send, 400, _error(message, 400, "cache_salt"))
            try:
                params = parse_kvcmas_params(request.get("kv_transfer_params"))
            except KvcmasParamsError as err:
                return await _send_json(send, 400, _error(str(err), 400, "kv_transfer_params"))
            if params is not None:
                request["cache_salt"] = session_cache_salt(
                    params.namespace, params.session, request.get("cache_salt") or None)
                body = json.dumps(request).encode()
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                scope = dict(scope, headers=headers)
        return await self.app(scope, _replay(body, receive), send)

    async def _stats(self, send) -> None:
        path = os.environ.get(STATS_FILE_ENV)
        if not path:
            return await _send_json(send, 404, _error(f"{STATS_FILE_ENV} is not set", 404))
        try:
            with open(path) as f:
                stats = json.load(f)
        except FileNotFoundError:
            stats = {}  # the worker has not written yet: nothing saved or injected
        return await _send_json(send, 200, stats)


def _replay(body: bytes, receive, first: dict | None = None):
    """A receive channel that hands the (possibly rewritten) body over once, then defers to
    the client's channel, so vLLM still notices a disconnect."""
    sent = False

    async def replay():
        nonlocal sent
        if first is not None and not sent:
            sent = True
            return first
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
