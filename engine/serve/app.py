"""The FastAPI app: routes, the guard middleware (API key, body limits), error handlers, the worker's lifespan.

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health (always open), /metrics (Prometheus
text; behind the API key like everything else but /health). With an API key the interactive docs (/docs, /redoc,
/openapi.json) are off: they would describe a private server to anyone.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.serve.chat import compile_chat_template, render_chat
from engine.serve.completions import OpenAIServing
from engine.serve.config import ServeConfig
from engine.serve.errors import install_error_handlers
from engine.serve.guard import GuardMiddleware
from engine.serve.metrics import Metrics
from engine.serve.protocol import ChatRequest, CompletionRequest
from engine.serve.worker import Worker


def create_app(eng: Any, cfg: ServeConfig | None = None, chat_template: str | None = None,
               special_tokens: dict[str, str] | None = None) -> FastAPI:
    """The server over `eng` (an engine.runtime.Engine). `chat_template`: a checkpoint's Jinja source (see
    chat.load_chat_template), rendered with its `special_tokens` (bos_token, ...); None: the built-in format."""
    cfg = cfg or ServeConfig()
    template = compile_chat_template(chat_template, special_tokens)
    worker = Worker(eng, cfg.queue_size)
    metrics = Metrics(worker)
    serving = OpenAIServing(eng, cfg, worker, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        worker.start()
        yield
        worker.stop()

    private = cfg.api_key is not None
    app = FastAPI(title="specbook engine", lifespan=lifespan, docs_url=None if private else "/docs",
                  redoc_url=None if private else "/redoc", openapi_url=None if private else "/openapi.json")
    app.state.serve_config = cfg  # launch.serve_in_thread takes its timeouts from here
    app.add_middleware(GuardMiddleware, cfg=cfg, metrics=metrics)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest):
        return await serving.complete(request, req, serving.encode_prompt(req.prompt), req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest):
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = render_chat(messages, template)
        except Exception as e:  # a checkpoint's template may reject a conversation (roles, order)
            raise HTTPException(400, f"chat template failed: {e}")
        return await serving.complete(request, req, serving.encode_prompt(prompt),
                                      req.max_completion_tokens or req.max_tokens, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model",
                                            "max_model_len": eng.max_seq_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.model_name, "queued": worker.jobs.qsize(),
                "running": worker.running is not None, "max_seq_len": eng.max_seq_len}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
