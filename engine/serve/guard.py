"""What every HTTP request passes before a route, as pure ASGI middleware (keeps streaming cancellation intact):

- the API key, when one is set, for every path but /health (a liveness probe), before any of the body is read;
- the body: a valid Content-Length within the limit, the limit again while reading (chunked uploads), and a deadline
  for the whole body - a client that sends the head and stalls gets 408 and the connection is closed;
- the per-path, per-status request counter.
"""
from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import HTTPException

from engine.serve.config import ServeConfig
from engine.serve.errors import error_response
from engine.serve.metrics import Metrics

OPEN_PATHS = ("/health",)


def authorized(headers: dict[bytes, bytes], api_key: str | None) -> bool:
    if api_key is None:
        return True
    given = headers.get(b"authorization", b"").decode("latin-1").removeprefix("Bearer ").strip()
    return hmac.compare_digest(given.encode(), api_key.encode())


class GuardMiddleware:
    def __init__(self, app: Any, cfg: ServeConfig, metrics: Metrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        max_body = self.cfg.max_body_bytes
        try:
            if scope["path"] not in OPEN_PATHS and not authorized(headers, self.cfg.api_key):
                await error_response(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")(
                    scope, receive, send_status)
            elif length is not None and not length.isdigit():
                await error_response(400, "invalid Content-Length header")(scope, receive, send_status)
            elif length is not None and int(length) > max_body:
                await error_response(413, f"request body of {int(length)} bytes exceeds {max_body} bytes")(
                    scope, receive, send_status)
            else:
                await self.app(scope, self.body_reader(receive), send_status)
        finally:
            self.metrics.count_request(scope["path"], status[0])

    def body_reader(self, receive: Any) -> Any:
        """`receive` with the size limit and the body deadline; after the body it passes messages straight through
        (a streaming response waits on it for the client's disconnect, which may come hours later)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.body_timeout_s
        received, done = 0, False

        async def receive_body() -> dict:
            nonlocal received, done
            if done:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"request body not received within {self.cfg.body_timeout_s:g} s",
                                    headers={"Connection": "close"}) from None
            received += len(msg.get("body", b""))
            if received > self.cfg.max_body_bytes:
                raise HTTPException(413, f"request body exceeds {self.cfg.max_body_bytes} bytes")
            done = msg["type"] != "http.request" or not msg.get("more_body", False)
            return msg

        return receive_body
