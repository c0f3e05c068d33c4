"""OpenAI-compatible HTTP server over engine.runtime.Engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (streaming SSE and not), GET /v1/models, /health,
/metrics (Prometheus text). Every choice carries SGLang-style `meta_info` with the speculative statistics
(spec_verify_ct, spec_accept_token_num, spec_accept_length), in the final chunk when streaming.

One worker thread owns the engine and runs one request at a time from a bounded queue; a full queue answers 429.
A client that disconnects mid-stream cancels its request at the next chunk. Text goes through Engine.encode /
Engine.decode (UTF-8 bytes for random-weight shapes without a tokenizer). Without a chat template (see
`load_chat_template`) chat messages are rendered as "<|role|>\\ncontent\\n" lines followed by "<|assistant|>\\n".
"""
from __future__ import annotations

import asyncio
import hmac
import json
import queue
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import click
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from engine.cli_options import engine_options, load_engine
from engine.errors import EngineError


@dataclass
class ServeConfig:
    model_name: str = "specbook"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: the cache length minus one
    max_tokens_limit: int = 4096
    queue_size: int = 64  # requests waiting behind the running one


# ----------------------------------------------------------------------------------------------- text <-> ids

class Detokenizer:
    """Incremental text of a growing id list; holds back text that may still become a stop string.

    Each step decodes only a window: the ids since the last clean boundary, with the ids before them as a prefix
    so that tokenizers which merge across tokens (leading spaces, byte fallback) decode as in one piece.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.prefix_at = self.read_at = 0  # ids[prefix_at:read_at] is the context of the next window
        self.text = ""  # decoded so far
        self.sent = 0  # characters already emitted
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """New text safe to emit, and whether a stop string was reached (text is cut before it)."""
        self.ids += ids
        self._decode(final=False)
        start = max(self.sent - self.hold, 0)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return self._emit(cut), True
        return self._emit(len(self.text) - self.hold), False

    def flush(self) -> str:
        self._decode(final=True)
        return self._emit(len(self.text))

    def _decode(self, final: bool) -> None:
        prefix = self.decode(self.ids[self.prefix_at:self.read_at])
        full = self.decode(self.ids[self.prefix_at:])
        # An incomplete multi-byte character decodes to U+FFFD: wait for the rest unless the answer is over.
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_at, self.read_at = self.read_at, len(self.ids)

    def _emit(self, end: int) -> str:
        new = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new


def load_chat_template(target: str | None) -> str | None:
    """A Jinja chat template shipped with a checkpoint (chat_template.jinja or tokenizer_config.json), if any."""
    if not target:
        return None
    d = Path(target)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        return tpl if isinstance(tpl, str) else None
    return None


def compile_chat_template(source: str | None) -> Any:
    """A sandboxed Jinja template (as transformers renders them), or None for the built-in format."""
    if source is None:
        return None
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # HF templates call it to reject a conversation
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_chat(messages: list[dict[str, str]], template: Any = None) -> str:
    if template is None:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    return template.render(messages=messages, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------ requests

class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints; unknown OpenAI fields are ignored, as other servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # SGLang/vLLM extension; 0 and -1 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # SGLang/vLLM extension: fixed-length outputs for benchmarks

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return [s for s in stops if s]


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


# ------------------------------------------------------------------------------------------------- worker

_END = object()


@dataclass
class Job:
    prompt_ids: list[int]
    params: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody listens any more
            self.cancelled.set()

    async def chunks(self) -> AsyncIterator[Any]:
        while (item := await self.out.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    """The only thread that touches the engine: runs queued jobs one after another."""

    def __init__(self, eng: Any, queue_size: int):
        self.eng = eng
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.running: Job | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.running is not None:
            self.running.cancelled.set()
        self._thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        self.jobs.put_nowait(job)  # queue.Full -> 429

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            if not job.cancelled.is_set():
                self.running = job
                self._generate(job)
                self.running = None
            job.emit(_END)

    def _generate(self, job: Job) -> None:
        stream = self.eng.stream(job.prompt_ids, **job.params)  # a generator: runs only when iterated
        try:
            for chunk in stream:
                job.emit(chunk)
                if job.cancelled.is_set():
                    break
        except Exception as e:  # reported to the request that caused it; the worker keeps serving
            job.emit(e)
        finally:
            stream.close()


# ------------------------------------------------------------------------------------------------ metrics

class Metrics:
    def __init__(self, worker: Worker):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specbook_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=r)
        self.prompt_tokens = Counter("specbook_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("specbook_generation_tokens", "Tokens generated", registry=r)
        self.verify_cycles = Counter("specbook_verify_cycles", "Target verify cycles", registry=r)
        self.accepted_tokens = Counter("specbook_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accept_length = Histogram("specbook_accept_length", "Tokens per verify cycle, per request",
                                       buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8), registry=r)
        Gauge("specbook_queue_depth", "Requests waiting for the engine", registry=r).set_function(
            worker.jobs.qsize)
        Gauge("specbook_running", "Requests being generated (0 or 1)", registry=r).set_function(
            lambda: int(worker.running is not None))


class GuardMiddleware:
    """Pure ASGI (keeps streaming cancellation intact): body-size limit and the per-status request counter."""

    def __init__(self, app: Any, max_body_bytes: int, metrics: Metrics):
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            msg = await receive()
            received += len(msg.get("body", b""))
            if received > self.max_body:
                raise HTTPException(413, f"request body exceeds {self.max_body} bytes")
            return msg

        try:
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and not length.isdigit():
                await _error(400, "invalid Content-Length header")(scope, receive, send_status)
            elif length is not None and int(length) > self.max_body:
                await _error(413, f"request body of {int(length)} bytes exceeds {self.max_body} bytes")(
                    scope, receive, send_status)
            else:
                await self.app(scope, limited_receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"  # bounded label values
            self.metrics.requests.labels(path, str(status[0])).inc()


# --------------------------------------------------------------------------------------------------- app

PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "code": status}}, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    errs = exc.errors()
    bad_json = [e for e in errs if e["type"] == "json_invalid"]
    if bad_json:
        return 400, f"malformed JSON: {bad_json[0].get('ctx', {}).get('error', bad_json[0]['msg'])}"
    parts = []
    for e in errs[:5]:
        where = ".".join(str(x) for x in e["loc"][1:]) or "body"
        parts.append(f"{where}: {e['msg']}")
    return 422, "; ".join(parts)


@dataclass
class Generation:
    """What one request has produced so far: ids, text, speculative counts, finish reason."""

    prompt_tokens: int
    detok: Detokenizer
    t0: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    verify_cycles: int = 0
    accepted_tokens: int = 0
    finish_reason: str | None = None  # set: generation is over
    hit_stop: bool = False  # a stop string ended it; the text is cut before it

    def feed(self, chunk: Any) -> str:
        self.tokens += len(chunk.token_ids)
        self.verify_cycles += chunk.verify_cycles
        self.accepted_tokens += chunk.accepted_tokens
        text, self.hit_stop = self.detok.add(list(chunk.token_ids))
        self.finish_reason = "stop" if self.hit_stop else chunk.finish_reason
        return text

    def finish(self) -> str:
        """The held-back tail of the text; a stream that ended without a reason ran out of tokens."""
        self.finish_reason = self.finish_reason or "length"
        return "" if self.hit_stop else self.detok.flush()

    def meta_info(self) -> dict[str, Any]:
        # The first token comes from the prefill, not from a verify cycle (see backends.sglang.accept_length).
        tau = (self.tokens - 1) / self.verify_cycles if self.verify_cycles else None
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "spec_verify_ct": self.verify_cycles, "spec_accept_token_num": self.accepted_tokens,
                "spec_accept_length": tau, "e2e_latency": time.perf_counter() - self.t0}

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}


async def cancel_on_disconnect(request: Request, job: Job, poll_s: float = 0.2) -> None:
    """A non-streaming client that hangs up (e.g. its timeout) should not keep the engine busy."""
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(poll_s)


class Server:
    def __init__(self, eng: Any, cfg: ServeConfig, chat_template: str | None = None):
        self.eng, self.cfg = eng, cfg
        self.chat_template = compile_chat_template(chat_template)
        self.max_prompt = min(cfg.max_prompt_tokens or eng.max_seq_len, eng.max_seq_len - 1)
        self.worker = Worker(eng, cfg.queue_size)
        self.metrics = Metrics(self.worker)

    # ---- request -> job
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.eng.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.eng.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise HTTPException(400, f"prompt token ids must lie in [0, {vocab})")
        if not ids:
            raise HTTPException(400, "the prompt encodes to zero tokens")
        if len(ids) > self.max_prompt:
            raise HTTPException(400, f"prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt} "
                                     f"(cache {self.eng.max_seq_len})")
        return ids

    def job_params(self, req: SamplingRequest, n_prompt: int, max_tokens: int | None) -> dict[str, Any]:
        room = self.eng.max_seq_len - n_prompt
        if max_tokens is None:
            max_tokens = min(self.cfg.max_tokens_limit, room)
        elif max_tokens > self.cfg.max_tokens_limit:
            raise HTTPException(400, f"max_tokens {max_tokens} exceeds this server's limit of "
                                     f"{self.cfg.max_tokens_limit}")
        elif max_tokens > room:
            raise HTTPException(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the cache "
                                     f"of {self.eng.max_seq_len} tokens")
        return dict(max_new_tokens=max_tokens, temperature=req.temperature, top_k=max(req.top_k, 0),
                    top_p=req.top_p, seed=req.seed if req.seed is not None else random.getrandbits(31),
                    stop_ids=() if req.ignore_eos else tuple(self.eng.eos_ids))

    def submit(self, ids: list[int], params: dict[str, Any]) -> Job:
        job = Job(ids, params, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except queue.Full:
            raise HTTPException(429, f"server busy: {self.cfg.queue_size} requests already queued; retry later")
        return job

    # ---- responses
    async def complete(self, request: Request, req: SamplingRequest, ids: list[int], max_tokens: int | None,
                       chat: bool):
        params = self.job_params(req, len(ids), max_tokens)
        job = self.submit(ids, params)
        gen = Generation(len(ids), Detokenizer(self.eng.decode, req.stops()))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.sse(job, gen, rid, chat, include_usage), media_type="text/event-stream")
        parts = []
        watch = asyncio.create_task(cancel_on_disconnect(request, job))
        try:
            async for chunk in job.chunks():
                parts.append(gen.feed(chunk))
                if gen.finish_reason is not None:
                    break
        except EngineError as e:
            raise HTTPException(400, str(e))
        finally:
            job.cancelled.set()
            watch.cancel()
            self.account(gen)
        text = "".join(parts) + gen.finish()
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "meta_info": gen.meta_info()}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.cfg.model_name, "choices": [choice], "usage": gen.usage()}

    async def sse(self, job: Job, gen: Generation, rid: str, chat: bool, include_usage: bool
                  ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": self.cfg.model_name}

        def event(choices: list[dict], **extra: Any) -> str:
            return f"data: {json.dumps(head | {'choices': choices} | extra)}\n\n"

        def choice(text: str, finish: str | None = None, **extra: Any) -> dict:
            body = {"delta": {"content": text}} if chat else {"text": text, "logprobs": None}
            return {"index": 0, **body, "finish_reason": finish, **extra}

        try:
            if chat:
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            async for chunk in job.chunks():
                if text := gen.feed(chunk):
                    yield event([choice(text)])
                if gen.finish_reason is not None:
                    break
            tail = gen.finish()
            yield event([choice(tail, gen.finish_reason, meta_info=gen.meta_info())])
            if include_usage:
                yield event([], usage=gen.usage())
        except Exception as e:  # the status line is already sent: report in-band, as OpenAI servers do
            status = 400 if isinstance(e, EngineError) else 500
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': status}})}\n\n"
        finally:  # also on client disconnect (the task is cancelled): stop generating
            job.cancelled.set()
            self.account(gen)
        yield "data: [DONE]\n\n"

    def account(self, gen: Generation) -> None:
        m = self.metrics
        m.prompt_tokens.inc(gen.prompt_tokens)
        m.generation_tokens.inc(gen.tokens)
        m.verify_cycles.inc(gen.verify_cycles)
        m.accepted_tokens.inc(gen.accepted_tokens)
        if gen.verify_cycles:
            m.accept_length.observe((gen.tokens - 1) / gen.verify_cycles)

    # ---- the app
    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            self.worker.start()
            yield
            self.worker.stop()

        app = FastAPI(title="specbook engine", lifespan=lifespan)
        app.add_middleware(GuardMiddleware, max_body_bytes=self.cfg.max_body_bytes, metrics=self.metrics)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
            return _error(exc.status_code, str(exc.detail))

        @app.exception_handler(Exception)
        async def crashed(_: Request, exc: Exception) -> JSONResponse:
            return _error(500, f"internal error: {type(exc).__name__}: {exc}")

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return _error(*_validation_message(exc))

        def authorize(request: Request) -> None:
            if self.cfg.api_key is None:
                return
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.cfg.api_key.encode()):
                raise HTTPException(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

        auth = [Depends(authorize)]

        @app.post("/v1/completions", dependencies=auth)
        async def completions(request: Request, req: CompletionRequest):
            return await self.complete(request, req, self.prompt_ids(req.prompt), req.max_tokens, chat=False)

        @app.post("/v1/chat/completions", dependencies=auth)
        async def chat_completions(request: Request, req: ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                prompt = render_chat(messages, self.chat_template)
            except Exception as e:  # a checkpoint's template may reject a conversation (roles, order)
                raise HTTPException(400, f"chat template failed: {e}")
            return await self.complete(request, req, self.prompt_ids(prompt),
                                       req.max_completion_tokens or req.max_tokens,
                                       chat=True)

        @app.get("/v1/models", dependencies=auth)
        async def models():
            return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model",
                                                "max_model_len": self.eng.max_seq_len}]}

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.cfg.model_name, "queued": self.worker.jobs.qsize(),
                    "running": self.worker.running is not None, "max_seq_len": self.eng.max_seq_len}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app


def create_app(eng: Any, cfg: ServeConfig | None = None, chat_template: str | None = None) -> FastAPI:
    return Server(eng, cfg or ServeConfig(), chat_template).app()


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run `app` under uvicorn in a background thread (port 0: a free one); yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
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


# ---------------------------------------------------------------------------------------------------- CLI

@click.command("serve")
@engine_options(2048, "KV-cache length: prompt + max_tokens must fit.", extra=[
    click.option("--host", default="127.0.0.1", show_default=True, help="Bind address; loopback unless told."),
    click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535)),
    click.option("--api-key", default=None, envvar="SPECBOOK_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    click.option("--model-name", default="specbook", show_default=True, help="Model id reported to clients."),
    click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1)),
    click.option("--max-prompt-tokens", default=None, type=click.IntRange(min=1), help="Default: the cache - 1."),
    click.option("--max-tokens-limit", default=4096, show_default=True, type=click.IntRange(min=1)),
    click.option("--queue-size", default=64, show_default=True, type=click.IntRange(min=1),
                 help="Requests waiting behind the running one; beyond it: 429."),
])
def serve_command(host: str, port: int, api_key: str | None, model_name: str, max_body_bytes: int,
                  max_prompt_tokens: int | None, max_tokens_limit: int, queue_size: int, debug: bool,
                  **load: Any) -> None:
    """OpenAI-compatible server for the bundled engine (/v1/completions, /v1/chat/completions, /metrics)."""
    import uvicorn

    try:
        eng = load_engine(**load)
    except EngineError as e:  # one line and exit 2 also when this command runs outside engine/__main__.py's group
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    cfg = ServeConfig(model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                      max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit, queue_size=queue_size)
    uvicorn.run(create_app(eng, cfg, load_chat_template(load["target"])), host=host, port=port, log_level="info")
