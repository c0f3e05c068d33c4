"""The generation thread: the only thread that touches the engine, running queued jobs one after another.

A job's chunks (or the exception that ended it) go back to the request's event loop through an asyncio queue; a
request that goes away sets `cancelled`, which stops its generation at the next chunk or skips it in the queue.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

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
        stream = None
        try:  # an engine may refuse in the call itself or at the first chunk: either way the worker lives on
            stream = self.eng.stream(job.prompt_ids, **job.params)
            for chunk in stream:
                job.emit(chunk)
                if job.cancelled.is_set():
                    break
        except Exception as e:  # reported to the request that caused it
            job.emit(e)
        finally:
            if stream is not None and hasattr(stream, "close"):
                stream.close()
