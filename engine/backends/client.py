"""Benchmark client for any OpenAI-compatible endpoint: bundled server, SGLang, vLLM.

Measures time to first token, inter-token latency, tok/s and the accept length the backend reports:
per-request `meta_info` (SGLang, the bundled server) or the difference of vLLM's Prometheus spec-decode
counters over the run. `python -m engine.backends.client --url http://127.0.0.1:8000 -n 32 -c 4`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np

from engine.backends import sglang, vllm
from engine.cli_options import (DEBUG_ATTRS, EXIT_CHECK_FAILED, EXIT_CODES, EXIT_OK, FiniteFloatRange,
                                OneLineErrors)
from engine.errors import EngineError


class Command(OneLineErrors, click.Command):
    """The client as `python -m engine`'s commands: one-line errors, the same exit codes (engine.cli_options)."""

    def main(self, args=None, prog_name=None, *a, **kw):
        return super().main(args, prog_name or "python -m engine.backends.client", *a, **kw)

# A small mixed prompt set (chat, code, reasoning, summary) so accept length is not measured on one kind of text.
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences why the sky is blue.",
    "List five practical tips for writing readable unit tests.",
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey? Show your steps.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Translate to French: 'The meeting has been moved to Thursday afternoon.'",
    "What is the difference between a process and a thread? Answer briefly.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    completion_tokens: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None  # streaming only
    chunk_gaps_s: list[float] = field(default_factory=list)  # gaps between content chunks (inter-token latency)
    meta_info: dict[str, Any] | None = None


@dataclass
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, xs: list[float]) -> "Stats | None":
        if not xs:
            return None
        a = np.asarray(xs, dtype=np.float64)
        return cls(float(a.mean()), *(float(np.percentile(a, q)) for q in (50, 90, 99)))


@dataclass
class BenchSummary:
    url: str
    requests: int
    concurrency: int
    ok: int
    failed: int
    duration_s: float
    completion_tokens: int
    output_tok_s: float  # all completion tokens / wall time
    request_tok_s: Stats | None  # per request: completion tokens / latency, prefill included
    decode_tok_s: Stats | None  # per request: (tokens - 1) / (latency - ttft), prefill excluded; streaming only
    ttft_ms: Stats | None
    itl_ms: Stats | None
    tpot_ms: Stats | None  # per request: (latency - ttft) / (tokens - 1)
    latency_s: Stats | None
    accept_length: float | None
    accept_source: str  # "meta_info", "vllm-metrics" or "none"
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_body(prompt: str, *, chat: bool, model: str, max_tokens: int, temperature: float, stream: bool,
               ignore_eos: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": stream, "return_meta_info": True}  # SGLang: per-request spec stats
    if ignore_eos:  # SGLang / vLLM / bundled extension: every answer runs to max_tokens
        body["ignore_eos"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _content(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _absorb(res: RequestResult, payload: dict[str, Any]) -> None:
    """Take token counts and meta_info from a response or stream chunk, whichever the backend sends."""
    for choice in payload.get("choices") or ():
        if choice.get("meta_info"):
            res.meta_info = choice["meta_info"]
    if payload.get("meta_info"):
        res.meta_info = payload["meta_info"]
    if payload.get("usage"):
        res.completion_tokens = int(payload["usage"].get("completion_tokens") or 0)


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> RequestResult:
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    chunks = 0  # content chunks of a stream
    try:
        if not body["stream"]:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {r.text[:200]}")
            _absorb(res, r.json())
        else:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    return RequestResult(ok=False, error=f"HTTP {r.status_code}: {text[:200]}")
                last = None
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    payload = json.loads(line[5:])
                    if "error" in payload:  # the status line was 200; the failure comes in-band
                        return RequestResult(ok=False, error=f"in-stream error: {payload['error']}")
                    _absorb(res, payload)
                    if any(_content(c) for c in payload.get("choices") or ()):
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - t0
                        else:
                            res.chunk_gaps_s.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    if not res.completion_tokens:  # no usage reported: meta_info, else one token per content chunk
        res.completion_tokens = int((res.meta_info or {}).get("completion_tokens") or chunks)
    res.ok = True
    res.latency_s = time.perf_counter() - t0
    return res


async def _served_model(client: httpx.AsyncClient) -> str:
    """The first model id of /v1/models: vLLM answers 404 to a model name it does not serve."""
    try:
        r = await client.get("/v1/models")
        return r.json()["data"][0]["id"] if r.status_code == 200 else "default"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


async def _scrape_counters(client: httpx.AsyncClient) -> vllm.SpecCounters | None:
    try:
        r = await client.get("/metrics")
        return vllm.parse_spec_counters(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def run_benchmark(url: str, prompts: list[str] | tuple[str, ...] = DEFAULT_PROMPTS, *, requests: int = 16,
                        concurrency: int = 1, max_tokens: int = 128, temperature: float = 0.0, chat: bool = True,
                        stream: bool = True, ignore_eos: bool = False, model: str | None = None,
                        api_key: str | None = None, timeout_s: float = 600.0) -> BenchSummary:
    """Send `requests` requests (prompts in turn), at most `concurrency` at a time, and summarize them."""
    if requests < 1 or concurrency < 1 or not prompts:
        raise EngineError("need requests >= 1, concurrency >= 1 and at least one prompt")
    if not url.startswith(("http://", "https://")):
        raise EngineError(f"url must start with http:// or https://, got {url!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s,
                                 limits=limits) as client:
        model = model or await _served_model(client)
        before = await _scrape_counters(client)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(i: int) -> RequestResult:
            body = build_body(prompts[i % len(prompts)], chat=chat, model=model, max_tokens=max_tokens,
                              temperature=temperature, stream=stream, ignore_eos=ignore_eos)
            async with gate:
                return await one_request(client, path, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(requests)))
        duration = time.perf_counter() - t0
        after = await _scrape_counters(client)
    return summarize(url, results, concurrency, duration, before, after)


def benchmark(url: str, prompts: list[str] | tuple[str, ...] = DEFAULT_PROMPTS, **kw: Any) -> BenchSummary:
    """run_benchmark from synchronous code, also where an event loop already runs (a Jupyter kernel)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_benchmark(url, prompts, **kw))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_benchmark(url, prompts, **kw)).result()


def summarize(url: str, results: list[RequestResult], concurrency: int, duration: float,
              before: vllm.SpecCounters | None = None, after: vllm.SpecCounters | None = None) -> BenchSummary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    accept, source = sglang.accept_length(r.meta_info for r in ok), "meta_info"
    if accept is None and after is not None:
        accept, source = (after - (before or vllm.SpecCounters())).accept_length, "vllm-metrics"
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok if r.ttft_s is not None and r.completion_tokens > 1 and r.latency_s > r.ttft_s]
    ms = 1000.0
    return BenchSummary(
        url=url, requests=len(results), concurrency=concurrency, ok=len(ok), failed=len(results) - len(ok),
        duration_s=duration, completion_tokens=tokens, output_tok_s=tokens / duration if duration > 0 else 0.0,
        request_tok_s=Stats.of([r.completion_tokens / r.latency_s for r in ok if r.latency_s > 0]),
        decode_tok_s=Stats.of([1.0 / t for t in tpot]),
        ttft_ms=Stats.of([r.ttft_s * ms for r in ok if r.ttft_s is not None]),
        itl_ms=Stats.of([g * ms for r in ok for g in r.chunk_gaps_s]),
        tpot_ms=Stats.of([t * ms for t in tpot]),
        latency_s=Stats.of([r.latency_s for r in ok]),
        accept_length=accept, accept_source=source if accept is not None else "none",
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


def format_summary(s: BenchSummary) -> str:
    rows = [("url", s.url), ("requests ok/failed", f"{s.ok}/{s.failed}"), ("concurrency", str(s.concurrency)),
            ("duration s", f"{s.duration_s:.2f}"), ("completion tokens", str(s.completion_tokens)),
            ("output tok/s", f"{s.output_tok_s:.1f}"),
            ("accept length", "n/a" if s.accept_length is None else f"{s.accept_length:.3f} ({s.accept_source})")]
    for name, st in (("request tok/s", s.request_tok_s), ("decode tok/s", s.decode_tok_s), ("TTFT ms", s.ttft_ms),
                     ("ITL ms", s.itl_ms),
                     ("TPOT ms", s.tpot_ms), ("latency s", s.latency_s)):
        if st is not None:
            rows.append((name, f"mean {st.mean:.2f}  p50 {st.p50:.2f}  p90 {st.p90:.2f}  p99 {st.p99:.2f}"))
    rows += [("error", e) for e in s.errors]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a .jsonl file ({"prompt": ...} per line) or a text file (one per line); default set if None."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        prompts = [json.loads(ln)["prompt"] for ln in lines] if p.suffix == ".jsonl" else lines
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise EngineError(f"cannot read prompts from {path}: {type(e).__name__}: {e}") from None
    if not prompts:
        raise EngineError(f"no prompts in {path}")
    return prompts


@click.command(cls=Command, epilog=EXIT_CODES.replace("no engine command checks anything", "a request failed"),
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="Server base URL.")
@click.option("--model", default=None, help="Model name sent in each request (default: the first of /v1/models).")
@click.option("--prompts", "prompts_path", default=None, help="Text file (one prompt a line) or .jsonl.")
@click.option("-n", "--requests", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("-c", "--concurrency", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloatRange(min=0.0))
@click.option("--chat/--completions", default=True, show_default=True, help="Endpoint to use.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Streaming gives TTFT and ITL.")
@click.option("--ignore-eos", is_flag=True, help="Generate max_tokens every time (SGLang/vLLM extension).")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True,
              type=FiniteFloatRange(min=0.0, min_open=True), help="Per-request timeout, seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--debug", **DEBUG_ATTRS)
def main(url: str, model: str | None, prompts_path: str | None, requests: int, concurrency: int, max_tokens: int,
         temperature: float, chat: bool, stream: bool, ignore_eos: bool, api_key: str | None, timeout_s: float,
         as_json: bool) -> None:
    """Benchmark an OpenAI-compatible endpoint."""
    summary = benchmark(
        url, load_prompts(prompts_path), requests=requests, concurrency=concurrency, max_tokens=max_tokens,
        temperature=temperature, chat=chat, stream=stream, ignore_eos=ignore_eos, model=model, api_key=api_key,
        timeout_s=timeout_s)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else format_summary(summary))
    click.get_current_context().exit(EXIT_CHECK_FAILED if summary.failed else EXIT_OK)


if __name__ == "__main__":
    main()
