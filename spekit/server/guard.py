"""Pure ASGI middleware in front of every route: the API key (401), the declared body size (413) and request
counts by endpoint and status. Pure ASGI, so that streaming responses and client disconnects pass untouched."""
from __future__ import annotations

import hmac
import json

from .metrics import Metrics
from .schemas import ApiError

OPEN_PATHS = {"/health"}      # answered without the key (load balancers' probes)
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}  # metric labels


async def send_error(send, err: ApiError, headers: list | None = None) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], [0]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            err = self._refusal(scope)
            if err is not None:
                status[0] = err.status
                extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else None
                return await send_error(send, err, extra)
            await self.app(scope, receive, counted)
        finally:
            self.metrics.inc("spekit_http_requests_total", endpoint=path if path in ENDPOINTS else "other",
                             status=status[0])

    def _refusal(self, scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                kind="authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return ApiError(413, f"the request body has {int(length)} bytes; this server takes at most "
                                 f"{self.max_body_bytes}", code="request_too_large")
        return None
