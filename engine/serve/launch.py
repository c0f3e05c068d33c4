"""Running the app under uvicorn, with the same settings for the CLI and for `serve_in_thread` (tests, runbooks):
keep-alive timeout and connection limit (uvicorn's own), and a deadline for the request head.

uvicorn arms no timer until a first response is sent, and a byte of a new request cancels the keep-alive timer, so a
client that connects and sends nothing, or half a request head, holds its socket for ever; a few hundred of them
exhaust the connection limit or the file descriptors. `HeadDeadlineProtocol` is uvicorn's h11 protocol plus that
deadline (the body's deadline is the guard middleware's: the app sees a request only once its head is complete).
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import EngineError
from engine.serve.config import ServeConfig


class HeadDeadlineProtocol(H11Protocol):
    """Closes a connection whose request head is not complete `head_timeout_s` after the connection was opened or
    the previous response was sent."""

    head_timeout_s: float = 20.0
    _head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, seconds: float) -> type["HeadDeadlineProtocol"]:
        return type(cls.__name__, (cls,), {"head_timeout_s": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request head is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already parse a pipelined next request
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request head did not arrive within %g s", self.head_timeout_s)
            self.transport.close()


def uvicorn_config(app: FastAPI, host: str, port: int, cfg: ServeConfig | None = None, **kw: Any) -> uvicorn.Config:
    cfg = cfg or getattr(app.state, "serve_config", None) or ServeConfig()
    return uvicorn.Config(app, host=host, port=port, http=HeadDeadlineProtocol.with_timeout(cfg.header_timeout_s),
                          timeout_keep_alive=cfg.keep_alive_s, limit_concurrency=cfg.limit_concurrency, **kw)


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn in a background thread (port 0: a free one); yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise EngineError("the bundled server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
