"""ServeConfig: the server's limits, timeouts and API key, shared by the app, the guard and the uvicorn settings."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError


@dataclass
class ServeConfig:
    model_name: str = "specbook"
    api_key: str | None = None  # None: no authentication; never empty (that would let every request in)
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the cache length minus one
    max_tokens_limit: int = 4096
    queue_size: int = 64  # requests waiting behind the running one; beyond: 429
    # Slow or stalled clients. uvicorn has no deadline for a request's head or body, so a client that sends half a
    # request and waits holds a socket (and, once the head is in, a task) for ever.
    header_timeout_s: float = 20.0  # connection opened (or last response sent) -> request head complete; then closed
    body_timeout_s: float = 30.0  # request head complete -> whole body read; then 408
    keep_alive_s: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's and vLLM's default)
    limit_concurrency: int = 256  # open connections + requests in flight; beyond: 503 (uvicorn)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise EngineError("the API key must not be empty (leave --api-key out to serve without authentication)")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise EngineError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.limit_concurrency < 1:
            raise EngineError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
