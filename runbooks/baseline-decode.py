# %% [markdown]
# # Baseline decode: the target alone
#
# How fast the bundled engine decodes with the target model alone, batch 1, greedy: with the whole decode step in
# one CUDA graph and eagerly, as a fraction of the machine's copy bandwidth, the cost of one forward of T tokens
# (what a verify step of T draft tokens costs), and transformers' own static-cache `generate` on the same weights
# as the peer. Random weights of a named shape: speed does not depend on the values.
#
# The game plan's team believed their baseline was 89 tok/s for weeks; it was 82-83. Every number below is
# re-measured by `runbook verify` on the same hardware profile.
#
# ```yaml
# title: Baseline decode tok/s (graph vs eager, bandwidth, forward cost per T, transformers peer)
# reproduces: [decode_tok_s, eager_decode_tok_s, bw_util, copy_gb_s, forward_ms_t1, forward_ms_t8, t8_over_t1,
#              peer_tok_s, peer_ratio, weight_gb]
# feeds: [findings.md, runbooks/index.md]
# depends: []
# profiles:
#   cpu: {shape: small, device: cpu, dtype: float32, prompt_len: 16, new_tokens: 32, repeats: 3, rel_tol: 0.75}
#   h200: {shape: llama-3.1-8b, device: cuda, dtype: bfloat16, prompt_len: 128, new_tokens: 256, repeats: 5,
#          sizes: [1, 2, 4, 8, 16, 32, 64], max_seq_len: 1024, rel_tol: 0.1}
# timeout: 1800
# cell_timeout: 1200
# ```

# %% tags=["parameters"]
shape = "small"  # named random-weight shape (engine.config.SHAPES)
device = "cpu"
dtype = "float32"
prompt_len = 16
new_tokens = 32
repeats = 3  # timed generations per variant; the median is recorded
sizes = [1, 2, 4, 8]  # token counts T of the forward-cost sweep (must include 1 and 8)
peer = True  # also time transformers' generate on the same weights
max_seq_len = 512
rel_tol = 0.75  # relative tolerance of the timings: shared CPU cores are noisy, a dedicated GPU is not

# %%
from engine.bench import BenchConfig, format_table, run_bench
from engine.runtime import Engine
from specbook import record

eng = Engine.load(shape=shape, device=device, dtype=dtype, max_seq_len=max_seq_len)
r = run_bench(eng, BenchConfig(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, sizes=tuple(sizes),
                               peer=peer))
print(format_table(r))

# %% [markdown]
# ## Forward cost per token count
#
# A decode step reads every weight once whatever T is, so while the matrix work is memory-bound a forward of 8
# tokens should cost little more than one. With CUDA graphs that holds (the field facts: 6.3 ms at T=1, 7.8 ms at
# T=8 for the 8b shape on an H200); eagerly, launch overhead dominates and it does not.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.5))
for name, costs in r.forward_ms.items():
    ax.plot(list(costs), list(costs.values()), marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("tokens per forward (T)")
ax.set_ylabel("ms per forward")
ax.set_title(f"{r.model} on {r.device}")
ax.legend()
plt.show()

# %% [markdown]
# ## Recorded numbers

# %%
graph, eager = r.decode["graph"], r.decode["eager"]
f = r.forward_ms["graph" if r.graphs else "eager"]
record("decode_tok_s", graph.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol, samples=graph.samples,
       description=f"decode tok/s, {'whole step in one CUDA graph' if r.graphs else 'eager (no graphs on CPU)'}")
record("eager_decode_tok_s", eager.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol, samples=eager.samples,
       description="decode tok/s without CUDA graphs")
record("bw_util", graph.bw_util, unit="fraction", direction="higher", rel_tol=rel_tol,
       description="weight bytes per token x tok/s over the measured copy bandwidth")
record("copy_gb_s", r.copy_gb_s, unit="GB/s", direction="higher", rel_tol=rel_tol,
       description="device-to-device copy bandwidth, bytes read plus written")
record("forward_ms_t1", f[1], unit="ms", direction="lower", rel_tol=rel_tol, description="one forward of 1 token")
record("forward_ms_t8", f[8], unit="ms", direction="lower", rel_tol=rel_tol, description="one forward of 8 tokens")
record("t8_over_t1", r.t8_over_t1, unit="x", direction="lower", rel_tol=rel_tol,
       description="cost of verifying 8 tokens relative to decoding 1")
record("peer_tok_s", r.peer_tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
       description="transformers generate, static cache, greedy, same weights")
record("peer_ratio", r.peer_ratio, unit="x", direction="higher", rel_tol=rel_tol,
       description="our decode tok/s over transformers'")
record("weight_gb", r.weight_bytes / 1e9, unit="GB", direction="none",
       description="weight bytes read per decode token (deterministic: a change means the model changed)")
