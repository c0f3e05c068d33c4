"""`python -m engine serve`: load the engine, check the server's options, run uvicorn (engine/__main__.py registers
this command)."""
from __future__ import annotations

import ipaddress
import os
import sys
from typing import Any

import click

from engine.cli_options import EXIT_BAD_INPUT, debug_requested, engine_options, load_engine
from engine.errors import EngineError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def fail(message: str) -> None:
    """Bad input: one line and exit 2, also when this command runs outside engine/__main__.py's group."""
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


@click.command("serve")
@engine_options(2048, "KV-cache length: prompt + max_tokens must fit.", extra=[
    click.option("--host", default="127.0.0.1", show_default=True, help="Bind address; loopback unless told."),
    click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535)),
    click.option("--api-key", default=None, envvar="SPECBOOK_API_KEY",
                 help="Require 'Authorization: Bearer KEY' everywhere but /health; not empty."),
    click.option("--model-name", default="specbook", show_default=True, help="Model id reported to clients."),
    click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1)),
    click.option("--max-prompt-tokens", default=None, type=click.IntRange(min=1), help="Default: the cache - 1."),
    click.option("--max-tokens-limit", default=4096, show_default=True, type=click.IntRange(min=1)),
    click.option("--queue-size", default=64, show_default=True, type=click.IntRange(min=1),
                 help="Requests waiting behind the running one; beyond it: 429."),
    click.option("--header-timeout", default=20.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                 help="Seconds a client has to send a request head; then the connection is closed."),
    click.option("--body-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                 help="Seconds a client has to send a request body after its head; then 408."),
    click.option("--keep-alive-timeout", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                 help="Seconds an idle keep-alive connection stays open."),
    click.option("--limit-concurrency", default=256, show_default=True, type=click.IntRange(min=1),
                 help="Open connections + requests in flight; beyond it: 503."),
])
def serve_command(host: str, port: int, api_key: str | None, model_name: str, max_body_bytes: int,
                  max_prompt_tokens: int | None, max_tokens_limit: int, queue_size: int, header_timeout: float,
                  body_timeout: float, keep_alive_timeout: float, limit_concurrency: int,
                  **load: Any) -> None:
    """OpenAI-compatible server for the bundled engine (/v1/completions, /v1/chat/completions, /metrics)."""
    import uvicorn

    from engine.serve.app import create_app
    from engine.serve.chat import load_chat_template, load_special_tokens
    from engine.serve.config import ServeConfig
    from engine.serve.launch import uvicorn_config

    if api_key is None and os.environ.get("SPECBOOK_API_KEY") == "":  # click reads an empty variable as unset
        fail("SPECBOOK_API_KEY is set but empty: set a key, or unset it to serve without authentication")
    try:  # the server's own options first: a typo should not cost a model load
        cfg = ServeConfig(model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                          max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                          queue_size=queue_size, header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                          keep_alive_s=keep_alive_timeout, limit_concurrency=limit_concurrency)
        eng = load_engine(**load)
        app = create_app(eng, cfg, load_chat_template(load["target"]), load_special_tokens(load["target"]))
    except EngineError as e:
        if debug_requested():
            raise
        fail(str(e))
    if not is_loopback(host) and api_key is None:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    uvicorn.Server(uvicorn_config(app, host, port, cfg, log_level="info")).run()
