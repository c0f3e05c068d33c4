# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Kimi-K2.5-INT4 under SGLang: baseline and 2-step EAGLE-3
#
# ```yaml
# title: Kimi-K2.5-INT4 under SGLang, TP 8 - baseline and 2-step EAGLE-3 at batch 1
# reproduces:
#   - "game plan: baseline 82-83 tok/s, 2-step EAGLE-3 59-61 tok/s (27% slower), accept length 2.0"
# feeds: [game-plan.md, findings.md, environment.md]
# depends: []
# profiles:
#   8x-rtx-pro-6000: {}
# timeout: 10800
# cell_timeout: 5400
# ```
#
# The game plan's own configuration: the Kimi-K2.5-INT4 target with the in-house K2.5 EAGLE-3 drafter, 2 draft
# steps as a chain (topk 1, 3 tokens verified per cycle), tensor parallel over 8 GPUs. Two servers are measured one
# after the other with the same client and prompts - the target alone, then with the drafter - at batch 1:
#
# - `baseline_tok_s`, `eagle3_2step_tok_s`: decode tok/s per request, prefill excluded (streaming, greedy);
# - `accept_length`: generated tokens per verify cycle, bonus included, as the backend reports it;
# - `eagle3_slowdown_pct`: how much slower EAGLE-3 is than the baseline (negative: faster).
#
# `backend` picks who serves: `sglang` or `vllm` (launched here from these parameters, NCCL settings included, so
# no `sitecustomize` is needed), `http` (servers already running at `baseline_url` / `eagle3_url`), or `bundled`
# (this repository's engine behind its OpenAI-compatible server). Only the 8x RTX PRO 6000 server can run it; on any
# other machine its numbers are reported, not verifiable here.

# %% tags=["parameters"]
backend = "sglang"  # bundled | http | sglang | vllm
target = "/models/Kimi-K2.5-INT4"
drafter = "/models/Kimi-K2.5-eagle3"
tp = 8
steps = 2
topk = 1
draft_tokens = 3
cuda_graphs = True
cuda_graph_max_bs: int | None = None
port = 30000
nccl_env: dict = {}  # e.g. {"NCCL_P2P_LEVEL": "SYS"}: passed to the server process, recorded with the run
extra_args: list = []  # more server flags, e.g. ["--mem-fraction-static", "0.85"]
trust_remote_code = True  # sglang / vllm run the Python shipped with the K2.5 checkpoint (its tokenizer needs it)
# backend=http only: servers already running, without and with the drafter
baseline_url = "http://127.0.0.1:30000"
eagle3_url = "http://127.0.0.1:30001"
requests = 16
concurrency = 1
max_tokens = 256
startup_timeout_s = 3600.0
outputs_dir: str | None = None

# %%
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from engine.backends import BACKENDS, SERVERS, LaunchConfig, SpecSettings, serving
from engine.backends.client import benchmark, format_summary
from specbook import record

if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
if backend in SERVERS and importlib.util.find_spec(backend) is None:
    raise RuntimeError(f"{backend} is not installed in this environment; this runbook needs the K2.5 server")
base_cfg = LaunchConfig(model=target, spec=SpecSettings(steps=steps, topk=topk, draft_tokens=draft_tokens), tp=tp,
                        cuda_graphs=cuda_graphs, cuda_graph_max_bs=cuda_graph_max_bs, port=port,
                        env={k: str(v) for k, v in nccl_env.items()}, extra_args=tuple(extra_args),
                        trust_remote_code=trust_remote_code, python=sys.executable,
                        startup_timeout_s=startup_timeout_s)
out = Path(outputs_dir) if outputs_dir else None


def measure(with_drafter: bool):
    cfg = dataclasses.replace(base_cfg, drafter=drafter if with_drafter else None)
    if backend in SERVERS:
        print(" ".join(SERVERS[backend](cfg).command()))
    url = eagle3_url if with_drafter else baseline_url
    with serving(backend, cfg, url, device="cuda", dtype="bfloat16", max_seq_len=4096) as url:
        run = dict(requests=requests, concurrency=concurrency, max_tokens=max_tokens, temperature=0.0)
        benchmark(url, requests=2, max_tokens=16)  # warm-up: graphs, caches, first-call costs
        summary = benchmark(url, **run)
        if with_drafter and summary.accept_length is None:
            # Some servers put meta_info only in non-streamed answers: ask again without streaming.
            again = benchmark(url, stream=False, **run)
            summary.accept_length, summary.accept_source = again.accept_length, again.accept_source
    print(format_summary(summary))
    if summary.failed or summary.decode_tok_s is None:
        raise RuntimeError(f"{summary.failed} of {summary.requests} requests failed or streamed no tokens: "
                           f"{summary.errors}")
    if out is not None:
        name = "eagle3" if with_drafter else "baseline"
        (out / f"{name}.json").write_text(json.dumps(summary.to_dict(), indent=2))
    return summary


# %% [markdown]
# ## Baseline: the target alone

# %%
base = measure(with_drafter=False)
base_tok_s = base.decode_tok_s.mean
record("baseline_tok_s", base_tok_s, unit="tok/s", direction="higher", rel_tol=0.05,
       description="batch-1 decode tok/s of the target alone, prefill excluded")

# %% [markdown]
# ## EAGLE-3, 2 draft steps

# %%
eagle = measure(with_drafter=True)
eagle_tok_s = eagle.decode_tok_s.mean
record("eagle3_2step_tok_s", eagle_tok_s, unit="tok/s", direction="higher", rel_tol=0.05,
       description=f"batch-1 decode tok/s with EAGLE-3, {steps} steps, topk {topk}")
if eagle.accept_length is None:
    raise RuntimeError(f"the {backend} server reported no speculative statistics")
record("accept_length", eagle.accept_length, unit="tokens/cycle", direction="higher", rel_tol=0.05,
       description=f"generated tokens per verify cycle, bonus included ({eagle.accept_source})")
record("eagle3_slowdown_pct", (1.0 - eagle_tok_s / base_tok_s) * 100.0, unit="%", direction="lower", rel_tol=0.15,
       description="EAGLE-3 tok/s below the baseline, in percent (negative: a speedup)")
