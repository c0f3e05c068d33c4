"""Prometheus metrics of one server (its own registry, so that several servers in one process do not collide).

Token counters count served requests only: a request the engine refused, or one cancelled before it ran, never
had its prompt processed (see completions.OpenAIServing.account).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# the label values of specbook_requests_total: the served paths, every other path counts as "other"
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class Metrics:
    def __init__(self, worker: Any):
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

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in PATHS else "other", str(status)).inc()  # bounded label values
