# %% [markdown]
# # Baseline decode: the target alone
#
# How fast the bundled engine decodes with the target model alone, batch 1, greedy: with the whole decode step in
# one CUDA graph and eagerly, as a fraction of the machine's copy bandwidth, the cost of one forward of T tokens
# (what a verify step of T draft tokens costs), and transformers' own static-cache `generate` on the same weights
# as the peer. Random weights of named shapes: speed does not depend on the values.
#
# The game plan's team believed their baseline was 89 tok/s for weeks; it was 82-83. Every number below is
# re-measured by `runbook verify` on the same hardware profile.
#
# The first shape of `shapes` is the main one: its metrics have plain names (`decode_tok_s`, ...); every further
# shape records the same metrics with its name as a suffix (`decode_tok_s.llama-3.2-1b`). With `torch_compile` the
# step's forward also runs through torch.compile inside the same hand-captured CUDA graph (`compiled_decode_tok_s`):
# the plain graph launches every small op (norms, RoPE, cache writes) as its own kernel; inductor fuses them.
#
# ```yaml
# title: Baseline decode tok/s (graph vs eager, bandwidth, forward cost per T, transformers peer)
# reproduces: [decode_tok_s, eager_decode_tok_s, ms_per_token, bw_util, copy_gb_s, forward_ms_t1, forward_ms_t8,
#              t8_over_t1, weight_gb]
# feeds: [findings.md, runbooks/index.md]
# depends: []
# profiles:
#   cpu: {shapes: [small, tiny], device: cpu, dtype: float32, prompt_len: 16, new_tokens: 32, repeats: 3,
#         threads: 1, torch_profile: true, rel_tol: 0.15}
#   h200: {shapes: [llama-3.1-8b, llama-3.2-1b], device: cuda, dtype: bfloat16, prompt_len: 128, new_tokens: 256,
#          repeats: 2, sizes: [1, 8], eager_tokens: 16, torch_compile: true, torch_profile: true, rel_tol: 0.1,
#          long_context: 32768}
# timeout: 3600
# cell_timeout: 2400
# gpu_memory_gib: 40  # on its GPU profiles: the 8B shape's bf16 weights, a 32K-token cache, the compiled graphs and the peer
# ```

# %% tags=["parameters"]
shapes = ["small", "tiny"]  # named random-weight shapes (engine.shapes.SHAPES); the first is the main one
device = "cpu"
dtype = "float32"
prompt_len = 16
new_tokens = 32
repeats = 3  # timed generations per variant; the median is recorded
sizes = [1, 2, 4, 8]  # token counts T of the forward-cost sweep (must include 1 and 8)
peer = True  # also time transformers' generate on the same weights (main shape)
eager = True  # also time the decode without CUDA graphs (main shape; on CPU nothing is captured anyway)
eager_tokens = 0  # new tokens of each eager generation (0: new_tokens): launch-bound, its rate holds on short runs
torch_compile = False  # also time the decode step compiled by torch.compile inside our CUDA graph
torch_profile = False  # print torch.profiler's kernel-level table of the fastest decode step
max_seq_len = 0  # KV-cache length; 0: what the run needs (attention reads the whole static cache every step)
long_context = 0  # also decode the main shape after a prompt of this many tokens (0: skip)
threads = 0  # CPU intra-op threads (0: torch's default); on shared cores more threads only contend
rel_tol = 0.15  # floor of the timings' relative tolerance (specbook.record derives it from the samples)

# %%
import gc

import torch

from engine.bench import BenchConfig, format_bench, run_bench
from engine.runtime import Engine
from specbook import record

if threads:
    torch.set_num_threads(threads)
results = {}
for i, shape in enumerate(shapes):  # the eager decode and the peer are the main shape's: the others' add only time
    cfg = BenchConfig(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, sizes=tuple(sizes),
                      peer=peer and i == 0, eager=eager and i == 0, eager_tokens=eager_tokens or None,
                      compile=torch_compile,
                      torch_profile=torch_profile)
    eng = Engine.load(shape=shape, device=device, dtype=dtype, max_seq_len=max_seq_len or cfg.cache_len())
    results[shape] = run_bench(eng, cfg)
    print(format_bench(results[shape]), end="\n\n")
    del eng  # free the weights and graphs before the next shape
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

# %% [markdown]
# ## Forward cost per token count
#
# A decode step reads every weight once whatever T is, so while the matrix work is memory-bound a forward of 8
# tokens should cost little more than one. With CUDA graphs that holds (the field facts: 6.3 ms at T=1, 7.8 ms at
# T=8 for the 8b shape on an H200); eagerly, launch overhead dominates and it does not.

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 3.5), squeeze=False)
for ax, (shape, r) in zip(axes[0], results.items()):
    for name, costs in r.forward_ms.items():
        ax.plot(list(costs), list(costs.values()), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (T)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"{shape} on {r.device} ({r.dtype})")
    ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Where the step's time goes
#
# The matrix-vector floor is every weight matrix times one token and nothing else, back to back in one graph: what a
# decode step would cost if attention, norms, RoPE, cache writes and sampling were free. The gap between it and the
# graph step is what fusion (the compiled variant) and better kernels can still win; with `torch_profile` the fastest
# step (the compiled graph where it was measured) is profiled replay by replay and its kernel time split by kind:
# matrix (the GEMVs), attention (the split-KV kernel of engine.decode_attention on CUDA) and everything else.

# %%
print(f"{'shape':<16}{'graph tok/s':>12}{'compiled':>10}{'floor':>8}{'beyond floor ms':>17}{'best bw util':>14}"
      f"{'T8/T1':>7}{'vs HF':>7}")
for shape, r in results.items():
    g, c = r.decode["graph"], r.decode.get("compiled")
    best = c if c and c.tok_s > g.tok_s else g
    floor = 1000 / r.gemv_ms if r.gemv_ms else float("nan")
    beyond = best.ms_per_token - r.gemv_ms if r.gemv_ms else float("nan")
    print(f"{shape:<16}{g.tok_s:>12.1f}{c.tok_s if c else float('nan'):>10.1f}{floor:>8.1f}{beyond:>17.3f}"
          f"{best.bw_util:>14.1%}{r.t8_over_t1:>7.2f}{r.peer_ratio or float('nan'):>7.2f}")
    if r.step_ms:
        print(f"{'':<16}{r.profiled} step kernels: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r.step_ms.items()
                                                          if k != "kernels") + f", {r.step_ms['kernels']:.0f} kernels")

# %% [markdown]
# ## Long context
#
# With `long_context`, the main shape decodes again after a prompt of that many tokens: every step then reads the
# context's keys and values besides the weights, so the decode attention (the split-KV kernel) takes a real share of
# the step. The bandwidth use counts both: weight bytes plus the K/V bytes of the static cache a step reads.

# %%
long = None
if long_context:
    cfg = BenchConfig(prompt_len=long_context, new_tokens=new_tokens, repeats=repeats, sizes=(1,), eager=False,
                      peer=False, compile=torch_compile, plain=not torch_compile, torch_profile=torch_profile)
    eng = Engine.load(shape=shapes[0], device=device, dtype=dtype, max_seq_len=cfg.cache_len())
    long = run_bench(eng, cfg)
    long_kv_bytes = eng.model.cache_bytes_per_token() * eng.max_seq_len  # a step reads the whole static cache
    print(format_bench(long))
    long_best = max(long.decode.values(), key=lambda d: d.tok_s)
    long_bw = (long.weight_bytes + long_kv_bytes) * long_best.tok_s / (long.copy_gb_s * 1e9)  # as bench's bw_util
    long_share = long.step_ms["attention"] / sum(long.step_ms[k] for k in ("matrix", "attention", "other")) \
        if long.step_ms else None
    print(f"{shapes[0]} after {long_context} tokens: {long_best.tok_s:.1f} tok/s, K/V read per step "
          f"{long_kv_bytes / 1e9:.2f} GB, bandwidth use {long_bw:.1%}"
          + (f", attention {long_share:.1%} of the step's kernel time" if long_share is not None else ""))
    del eng
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

# %% [markdown]
# ## Recorded numbers

# %%
def record_shape(r, suffix: str) -> None:
    """The numbers of one shape; names carry `suffix` (empty for the main shape, `.<shape>` for the others)."""
    how = "whole step in one CUDA graph" if r.graphs else "eager (no graphs on CPU)"
    variants = {"graph": ("", how), "compiled": ("compiled_", "forward through torch.compile inside our graph"),
                "eager": ("eager_", "without CUDA graphs")}
    for variant, d in r.decode.items():
        prefix, what = variants[variant]
        record(f"{prefix}decode_tok_s{suffix}", d.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
               samples=d.samples, description=f"{r.model}: decode tok/s, {what}")
        if variant != "eager":
            record(f"{prefix}bw_util{suffix}", d.bw_util, unit="fraction", direction="higher", rel_tol=rel_tol,
                   description=f"{r.model}: weight bytes per token x tok/s over the measured copy bandwidth, {what}")
    record(f"ms_per_token{suffix}", r.decode["graph"].ms_per_token, unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{r.model}: decode ms per token, {how}")
    f = r.forward_ms["graph" if r.graphs else "eager"]
    record(f"forward_ms_t1{suffix}", f[1], unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{r.model}: one forward of 1 token")
    record(f"forward_ms_t8{suffix}", f[8], unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{r.model}: one forward of 8 tokens")
    record(f"t8_over_t1{suffix}", r.t8_over_t1, unit="x", direction="lower", rel_tol=rel_tol,
           description=f"{r.model}: cost of a forward of 8 tokens relative to 1")
    if r.gemv_ms:
        record(f"gemv_floor_ms{suffix}", r.gemv_ms, unit="ms", direction="lower", rel_tol=rel_tol,
               description=f"{r.model}: every weight matrix times one token, nothing else (the step's floor)")
    if r.step_ms:  # where the fastest step's kernel time goes (the profiler)
        for kind in ("matrix", "attention", "other"):
            record(f"step_{kind}_ms{suffix}", r.step_ms[kind], unit="ms", direction="lower", rel_tol=rel_tol,
                   description=f"{r.model}: {kind} kernel time of one decode step ({r.profiled})")
    if r.peer_tok_s:
        record(f"peer_tok_s{suffix}", r.peer_tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
               description=f"{r.model}: transformers generate, static cache, greedy, same weights and prompt")
        record(f"peer_ratio{suffix}", r.peer_ratio, unit="x", direction="higher", rel_tol=rel_tol,
               description=f"{r.model}: our graph decode tok/s over transformers'")
    record(f"weight_gb{suffix}", r.weight_bytes / 1e9, unit="GB", direction="none",
           description=f"{r.model}: weight bytes read per decode token (deterministic: a change means the model "
                       "changed)")


record("copy_gb_s", results[shapes[0]].copy_gb_s, unit="GB/s", direction="higher", rel_tol=rel_tol,
       description="device-to-device copy bandwidth, bytes read plus written")
for i, shape in enumerate(shapes):
    record_shape(results[shape], "" if i == 0 else f".{shape}")
if long is not None:
    how = "compiled in our graph" if "compiled" in long.decode else "whole step in one CUDA graph"
    record("long_context_tok_s", long_best.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
           samples=long_best.samples, description=f"{long.model}: decode tok/s after a {long_context}-token prompt, "
                                                  f"{how}")
    record("long_context_bw_util", long_bw, unit="fraction", direction="higher", rel_tol=rel_tol,
           description=f"{long.model} after {long_context} tokens: (weight + K/V bytes per step) x tok/s over the "
                       "measured copy bandwidth")
    if long_share is not None:
        record("long_context_attention_share", long_share, unit="fraction", direction="none", kind="noisy",
               rel_tol=rel_tol, description=f"{long.model} after {long_context} tokens: decode attention's share of "
                                            "the step's kernel time")
