"""Serving /v1/completions and /v1/chat/completions: a request -> checked prompt ids and sampling parameters -> a
job for the worker -> one JSON answer or a stream of SSE chunks, with SGLang-style `meta_info` (speculative
statistics) in every choice, in the final chunk when streaming.

A client that disconnects cancels its request: a stream at its next chunk, a plain request through a watcher.
"""
from __future__ import annotations

import asyncio
import json
import queue
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

from engine.errors import EngineError
from engine.metrics import accept_length as tokens_per_cycle
from engine.serve.config import ServeConfig
from engine.serve.detok import Detokenizer
from engine.serve.errors import stream_error
from engine.serve.metrics import Metrics
from engine.serve.protocol import SamplingRequest, chunk_body, chunk_choice, completion_body, role_choice
from engine.serve.worker import Job, Worker


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
        # The first token comes from the prefill, not from a verify cycle: engine.metrics.accept_length, which
        # reads 1 / spec_verify_ct lower than SGLang's own spec_accept_length (completion_tokens / spec_verify_ct).
        tau = self.accept_length()
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "spec_verify_ct": self.verify_cycles, "spec_accept_token_num": self.accepted_tokens,
                "spec_accept_length": tau, "e2e_latency": time.perf_counter() - self.t0}

    def accept_length(self) -> float | None:
        """engine.metrics.accept_length of this request, None without a verify cycle."""
        return tokens_per_cycle(self.tokens - 1, self.verify_cycles) if self.verify_cycles else None

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


class OpenAIServing:
    def __init__(self, eng: Any, cfg: ServeConfig, worker: Worker, metrics: Metrics):
        self.eng, self.cfg, self.worker, self.metrics = eng, cfg, worker, metrics
        self.max_prompt = min(cfg.max_prompt_tokens or eng.max_seq_len, eng.max_seq_len - 1)

    # ---- request -> job
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
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
                       chat: bool) -> Any:
        params = self.job_params(req, len(ids), max_tokens)
        job = self.submit(ids, params)
        gen = Generation(len(ids), Detokenizer.for_engine(self.eng, req.stops()))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(self.sse(job, gen, rid, chat, req.include_usage()),
                                     media_type="text/event-stream")
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
        return completion_body(rid, int(time.time()), self.cfg.model_name, chat, text, gen.finish_reason,
                               gen.meta_info(), gen.usage())

    async def sse(self, job: Job, gen: Generation, rid: str, chat: bool, include_usage: bool
                  ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(choices: list[dict], **extra: Any) -> str:
            return f"data: {json.dumps(chunk_body(rid, created, self.cfg.model_name, chat, choices, **extra))}\n\n"

        try:
            if chat:
                yield event([role_choice()])
            async for chunk in job.chunks():
                if text := gen.feed(chunk):
                    yield event([chunk_choice(chat, text)])
                if gen.finish_reason is not None:
                    break
            tail = gen.finish()
            yield event([chunk_choice(chat, tail, gen.finish_reason, meta_info=gen.meta_info())])
            if include_usage:
                yield event([], usage=gen.usage())
        except Exception as e:  # the status line is already sent: report in-band, as OpenAI servers do
            yield stream_error(e)
        finally:  # also on client disconnect (the task is cancelled): stop generating
            job.cancelled.set()
            self.account(gen)
        yield "data: [DONE]\n\n"

    def account(self, gen: Generation) -> None:
        """Count a request that was served: the engine prefilled its prompt (its first token came back). One the
        engine refused, or that was cancelled while it waited in the queue, counts nowhere but in the requests
        counter."""
        if not gen.tokens:
            return
        m = self.metrics
        m.prompt_tokens.inc(gen.prompt_tokens)
        m.generation_tokens.inc(gen.tokens)
        m.verify_cycles.inc(gen.verify_cycles)
        m.accepted_tokens.inc(gen.accepted_tokens)
        if gen.verify_cycles:
            m.accept_length.observe(gen.accept_length())
