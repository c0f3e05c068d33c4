"""External serving engines (SGLang, vLLM) and one benchmark client for every OpenAI-compatible endpoint.

`serving(backend, cfg)` is what runbooks use to get a server for one measurement, whichever engine serves it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.backends.base import LaunchConfig, ServerProcess
from engine.backends.sglang import SGLangServer
from engine.backends.vllm import VLLMServer
from engine.errors import EngineError
from engine.spec_settings import SpecSettings

SERVERS: dict[str, type[ServerProcess]] = {"sglang": SGLangServer, "vllm": VLLMServer}
BACKENDS = ("bundled", "http", *SERVERS)

__all__ = ["BACKENDS", "LaunchConfig", "SERVERS", "SpecSettings", "serving"]


@contextmanager
def serving(backend: str, cfg: LaunchConfig, url: str | None = None, **engine_kw: Any) -> Iterator[str]:
    """The base URL of a server configured by `cfg`, stopped afterwards.

    http: `url`, a server that is already running; bundled: this repository's engine (cfg.model is a target
    directory; `engine_kw` go to Engine.load: device, dtype, max_seq_len, ...) behind engine.serve in a thread,
    on a free port; sglang / vllm: launched as a subprocess from `cfg`.
    """
    if backend == "http":
        if not url:
            raise EngineError("backend http needs the URL of a running server")
        yield url
    elif backend == "bundled":
        from engine.runtime import Engine
        from engine.serve import ServeConfig, create_app, load_chat_template, load_special_tokens, serve_in_thread

        eng = Engine.load(target=cfg.model, drafter=cfg.drafter, cuda_graphs=cfg.cuda_graphs, steps=cfg.spec.steps,
                          topk=cfg.spec.topk, draft_tokens=cfg.spec.draft_tokens, **engine_kw)
        app = create_app(eng, ServeConfig(api_key=cfg.api_key), load_chat_template(cfg.model),
                         load_special_tokens(cfg.model))
        with serve_in_thread(app, cfg.host) as base:
            yield base
    elif backend in SERVERS:
        with SERVERS[backend](cfg) as server:
            yield server.base_url
    else:
        raise EngineError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
