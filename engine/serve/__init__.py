"""OpenAI-compatible HTTP server over engine.runtime.Engine (FastAPI + uvicorn), one module per concern:

    config.py       ServeConfig: limits, timeouts, the API key
    protocol.py     OpenAI request models (bad fields -> 422) and answer bodies
    chat.py         chat templates (transformers' sandboxed renderer) and the built-in format
    detok.py        incremental detokenizing with stop strings (tokenizers' DecodeStream)
    worker.py       the generation thread: the only one that touches the engine, one job at a time
    completions.py  a request -> a job -> a JSON answer or an SSE stream, with meta_info; per-request accounting
    metrics.py      Prometheus metrics
    errors.py       every error as the OpenAI {"error": {...}} envelope
    guard.py        ASGI middleware: API key, body size and deadline, request counter
    app.py          the FastAPI app: routes, middleware, handlers (create_app)
    launch.py       uvicorn settings (head deadline, keep-alive, connection limit), serve_in_thread
    cli.py          `python -m engine serve`

Endpoints: POST /v1/completions and /v1/chat/completions (streaming SSE and not), GET /v1/models, /health,
/metrics. Every choice carries SGLang-style `meta_info` with the speculative statistics (spec_verify_ct,
spec_accept_token_num, spec_accept_length), in the final chunk when streaming. One worker thread runs one request
at a time from a bounded queue; a full queue answers 429.
"""
from engine.serve.app import create_app
from engine.serve.chat import compile_chat_template, load_chat_template, load_special_tokens, render_chat
from engine.serve.cli import serve_command
from engine.serve.config import ServeConfig
from engine.serve.detok import Detokenizer
from engine.serve.launch import serve_in_thread

__all__ = ["Detokenizer", "ServeConfig", "compile_chat_template", "create_app", "load_chat_template",
           "load_special_tokens", "render_chat", "serve_command", "serve_in_thread"]
