"""Accept length per prompt set through a serving engine: one server (SGLang at scale, the bundled server in tests),
the benchmark client, one summary per prompt set."""
from __future__ import annotations

from typing import Any

from engine.backends import serving
from engine.backends.base import LaunchConfig, SpecSettings
from engine.backends.client import BenchSummary, benchmark, load_prompts
from engine.errors import EngineError


def accept_by_prompt_set(backend: str, cfg: LaunchConfig, prompt_sets: dict[str, str | None], *, requests: int,
                         max_tokens: int, concurrency: int = 1, url: str | None = None,
                         **engine_kw: Any) -> dict[str, BenchSummary]:
    """Serve `cfg` (target + drafter) once and measure each prompt set: greedy, non-streamed (SGLang puts the
    per-request spec_verify_ct in the meta_info of whole answers).

    prompt_sets: name -> prompts file (.jsonl with "prompt", or one prompt a line); {} or a None path: the client's
    default mixed set. Files are read before the server starts, so a bad path fails in seconds, not after loading.
    """
    if not cfg.drafter:
        raise EngineError("accept length needs a drafter (cfg.drafter)")
    sets = {name: load_prompts(path) for name, path in (prompt_sets or {"default": None}).items()}
    out: dict[str, BenchSummary] = {}
    with serving(backend, cfg, url, **engine_kw) as base:
        benchmark(base, requests=2, max_tokens=16, stream=False)  # warm-up: graphs, caches, first-call costs
        for name, prompts in sets.items():
            s = benchmark(base, prompts, requests=requests, concurrency=concurrency, max_tokens=max_tokens,
                          temperature=0.0, stream=False)
            if s.failed:
                raise EngineError(f"prompt set {name}: {s.failed} of {s.requests} requests failed: {s.errors}")
            if s.accept_length is None:
                raise EngineError(f"prompt set {name}: the {backend} server reported no speculative statistics")
            out[name] = s
    return out


def chain_accept_by_prompt_set(backend: str, target: str, drafter: str, chain_steps: int,
                               prompt_sets: dict[str, str | None], *, requests: int, max_tokens: int,
                               launch: dict[str, Any] | None = None, url: str | None = None,
                               **engine_kw: Any) -> dict[str, BenchSummary]:
    """accept_by_prompt_set for `drafter` on `target` as a greedy chain of `chain_steps` draft steps (a verify of
    chain_steps + 1 tokens): how the approach runbooks measure a drafter under a server. `launch`: the other
    LaunchConfig fields (tp, env, extra_args, python, ...)."""
    cfg = LaunchConfig(model=target, drafter=drafter, **(launch or {}),
                       spec=SpecSettings(steps=chain_steps, topk=1, draft_tokens=chain_steps + 1))
    return accept_by_prompt_set(backend, cfg, prompt_sets, requests=requests, max_tokens=max_tokens, url=url,
                                **engine_kw)


def mean_accept(summaries: dict[str, BenchSummary]) -> float:
    """The headline over prompt sets: their plain mean, each set weighing the same whatever its answer lengths."""
    if not summaries:
        raise EngineError("no prompt sets measured")
    return sum(s.accept_length for s in summaries.values()) / len(summaries)
