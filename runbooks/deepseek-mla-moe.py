# %% [markdown]
# # DeepSeek-V3 family: MLA + MoE decode, verify and EAGLE-3 cycle cost
#
# Kimi-K2 and K2.5 are DeepSeek-V3-architecture models: multi-head latent attention (MLA) and mixture-of-experts
# layers. The game plan's slowdown came from the verify step of exactly such a model running without CUDA graphs
# (~30 ms per EAGLE-3 cycle against ~12 ms per decode step). This runbook measures the same quantities on a
# DeepSeek-V3-shaped miniature with random weights (speed does not depend on the values): decode tok/s with the
# whole step in one CUDA graph and eagerly, the cost of a verify forward of 8 tokens against a decode step, and one
# EAGLE-3 chain cycle (7 draft steps, 8 tokens verified) with the verify captured and eager - the slow path
# reproduced in shape, then fixed. It also records what MLA's compressed cache saves: bytes per token of cache
# (latent + rope key) against the expanded per-head keys and values.
#
# The drafter has random weights, so it is almost never accepted: the cycle's cost does not depend on acceptance
# (a chain always drafts and verifies the same number of tokens), and accept length is not what is measured here.
#
# ```yaml
# title: DeepSeek-V3 family (MLA + MoE) - graph vs eager decode, verify of 8 tokens, EAGLE-3 cycle, cache bytes, transformers peer
# reproduces: [decode_tok_s, eager_decode_tok_s, graph_speedup, forward_ms_t1, forward_ms_t8, t8_over_t1,
#              verify_bytes_over_step, eager_forward_ms_t8, cycle_ms, eager_verify_cycle_ms, cycle_over_decode,
#              eager_cycle_over_decode, weight_gb, cache_bytes_per_token, cache_ratio, kimi_k2_cache_kib_per_token,
#              kimi_k2_cache_ratio]
# feeds: [findings.md, runbooks/index.md]
# depends: []
# profiles:
#   cpu: {shape: deepseek-v3-tiny, device: cpu, dtype: float32, prompt_len: 16, new_tokens: 24, repeats: 3,
#         max_seq_len: 128, rel_tol: 0.15}
#   h200: {shape: deepseek-v3-mini, device: cuda, dtype: bfloat16, prompt_len: 128, new_tokens: 128, repeats: 2,
#          eager_tokens: 16, max_seq_len: 1024, torch_compile: true, torch_profile: true, peer: true, rel_tol: 0.15}
# timeout: 1800
# cell_timeout: 1200
# gpu_memory_gib: 32  # on its GPU profiles: the MLA and MoE shapes, compiled; records keep each run's peak
# ```

# %% tags=["parameters"]
shape = "deepseek-v3-tiny"  # named random-weight shape (engine.shapes.SHAPES), model_type deepseek_v3
device = "cpu"
dtype = "float32"
prompt_len = 16
new_tokens = 24
repeats = 3  # timed generations per variant; the median is recorded
eager_tokens = 0  # new tokens of each eager generation, decode and cycle (0: new_tokens): launch-bound, a short run
# measures its rate as well
steps = 7  # EAGLE-3 chain: draft steps per cycle (steps + 1 tokens verified)
max_seq_len = 128
torch_compile = False  # also time the decode with the forward through torch.compile inside the graph
torch_profile = False  # split the fastest decode step's kernel time: matrix, attention, other (the profiler)
peer = False  # also time transformers' DeepseekV3 generate (static cache) on the same weights: the in-run peer
rel_tol = 0.15  # floor of the timings' relative tolerance (specbook.record derives it from the samples)

# %%
import statistics

import torch

from engine import deepseek
from engine.bench import BenchConfig, format_bench, random_prompt, run_bench
from engine.drafter import new_drafter
from engine.runtime import Engine
from engine.shapes import shape_config
from engine.speculate import SpecDecoder
from specbook import record

eng = Engine.load(shape=shape, device=device, dtype=dtype, max_seq_len=max_seq_len)
model = eng.model
if not model.cfg.is_mla:
    raise ValueError(f"shape {shape!r} is not a DeepSeek-V3-family shape")
r = run_bench(eng, BenchConfig(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, sizes=(1, 8),
                               eager_tokens=eager_tokens or None,
                               peer=peer, compile=torch_compile, torch_profile=torch_profile))
print(format_bench(r))

# %% [markdown]
# ## EAGLE-3 cycle against a decode step
#
# One chain cycle: `steps` drafter forwards, one target forward over `steps + 1` tokens, the accept step. With the
# verify captured in a CUDA graph it should cost little more than the verify forward; eagerly it pays every kernel
# launch of the MoE target again, as the game plan's server did.

# %%
prompt = random_prompt(model.cfg.vocab_size, prompt_len, 0)
drafter = new_drafter(model.cfg, torch.arange(min(32000, model.cfg.vocab_size)), embedding=model.embed_tokens,
                      device=device, dtype=dtype)


def cycle_ms(eager_verify: bool) -> tuple[float, dict[str, float]]:
    """Median ms per cycle over `repeats` generations, and one timed run's split of a cycle."""
    dec = SpecDecoder(model, drafter, max_seq_len, steps=steps, topk=1, cuda_graphs=True, eager_verify=eager_verify)
    n = (eager_tokens or new_tokens) if eager_verify else new_tokens
    dec.generate(prompt, 8)  # capture the graphs
    per_cycle = [1000 * g.decode_s / g.verify_cycles for g in (dec.generate(prompt, n) for _ in range(repeats))]
    t = dec.generate(prompt, n, timed_phases=True)
    split = {k: 1000 * getattr(t, f"{k}_s") / t.verify_cycles for k in ("draft", "verify", "other")}
    return statistics.median(per_cycle), split


graph_cycle, graph_split = cycle_ms(eager_verify=False)
eager_cycle, eager_split = cycle_ms(eager_verify=True)
decode_ms = r.decode["graph"].ms_per_token
print(f"decode step {decode_ms:.2f} ms; EAGLE-3 cycle ({steps} steps) {graph_cycle:.2f} ms with the verify "
      f"captured, {eager_cycle:.2f} ms eager")
for name, split in (("captured verify", graph_split), ("eager verify", eager_split)):
    print(f"  {name:16} " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()))

# %% [markdown]
# ## What a verify reads
#
# A decode token reads `num_experts_per_tok` routed experts a layer; a verify of 8 tokens reads the union of their
# choices. In a memory-bound step the weight bytes read set the time, so this ratio is where a verify's cost over a
# decode step comes from, beside launch and routing overhead (`t8_over_t1` measures the time ratio). The count is
# exact for these weights and tokens.

# %%
verify_ids = torch.tensor([random_prompt(model.cfg.vocab_size, 8, 1)], device=model.device)
reads = deepseek.expert_reads(model, verify_ids, torch.arange(prompt_len, prompt_len + 8, device=model.device))
verify_bytes_ratio = reads.weight_bytes / model.weight_bytes()
f = r.forward_ms["graph" if r.graphs else "eager"]
print(f"a verify of 8 tokens reads {reads.mean:.1f} of {model.cfg.n_routed_experts} routed experts a layer (a decode "
      f"token {model.cfg.num_experts_per_tok}): {reads.weight_bytes / 1e9:.3f} GB of weights, "
      f"{verify_bytes_ratio:.2f}x a decode step's; its forward takes {f[8] / f[1]:.2f}x a decode forward's time")

# %% [markdown]
# ## Cache bytes per token: latent against expanded
#
# MLA caches one latent vector (kv_lora_rank) and one shared rope key per token and layer; attention runs over it
# directly (weight absorption), so nothing is expanded per head. The expanded form would hold every head's key
# (qk_nope + qk_rope dims) and value.

# %%
mini = deepseek.cache_bytes_per_token(model.cfg, model.dtype)
k2 = deepseek.cache_bytes_per_token(shape_config("kimi-k2"), torch.bfloat16)
assert model.cache_bytes_per_token() == mini.latent  # the allocated cache is the compressed one
print(f"{shape}: {mini.latent} B/token cached, {mini.expanded} B expanded ({mini.ratio:.1f}x)")
print(f"kimi-k2 (bf16): {k2.latent / 1024:.1f} KiB/token cached, {k2.expanded / 1024:.1f} KiB expanded "
      f"({k2.ratio:.1f}x)")

# %% [markdown]
# ## Recorded numbers

# %%
graph, eager = r.decode["graph"], r.decode["eager"]
mode = "whole step in one CUDA graph" if r.graphs else "eager (no graphs on CPU)"
record("decode_tok_s", graph.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol, samples=graph.samples,
       description=f"decode tok/s, {mode}")
record("eager_decode_tok_s", eager.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
       samples=eager.samples, description="decode tok/s without CUDA graphs")
record("graph_speedup", graph.tok_s / eager.tok_s, unit="x", direction="higher", rel_tol=rel_tol,
       description="graph decode tok/s over eager")
record("forward_ms_t1", f[1], unit="ms", direction="lower", rel_tol=rel_tol, description=f"one decode forward, {mode}")
record("forward_ms_t8", f[8], unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"one verify forward of 8 tokens, {mode}")
record("t8_over_t1", f[8] / f[1], unit="x", direction="lower", rel_tol=rel_tol,
       description="verify of 8 tokens over a decode step (MoE: 8 tokens route to more experts than 1)")
record("eager_forward_ms_t8", r.forward_ms["eager"][8], unit="ms", direction="lower", rel_tol=rel_tol,
       description="one verify forward of 8 tokens without CUDA graphs")
record("cycle_ms", graph_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"EAGLE-3 chain cycle ({steps} steps), drafter and verify captured")
record("eager_verify_cycle_ms", eager_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"EAGLE-3 chain cycle ({steps} steps), verify eager (the game plan's path)")
record("cycle_over_decode", graph_cycle / decode_ms, unit="x", direction="lower", rel_tol=rel_tol,
       description="captured cycle over a graph decode step")
record("eager_cycle_over_decode", eager_cycle / decode_ms, unit="x", direction="lower", rel_tol=rel_tol,
       description="eager-verify cycle over a graph decode step (game plan: ~30 ms / 12 ms = 2.5x)")
if "compiled" in r.decode:
    c = r.decode["compiled"]
    record("compiled_decode_tok_s", c.tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol, samples=c.samples,
           description="decode tok/s, forward through torch.compile inside the CUDA graph")
    record("compiled_bw_util", c.bw_util, unit="fraction", direction="higher", rel_tol=rel_tol,
           description="compiled decode: bytes of the weights a token reads (active experts only) x tok/s over the "
                       "copy bandwidth")
if r.peer_tok_s:
    record("peer_tok_s", r.peer_tok_s, unit="tok/s", direction="higher", rel_tol=rel_tol,
           description="transformers DeepseekV3 generate, static cache, greedy, same weights and prompt")
    record("peer_ratio", r.peer_ratio, unit="x", direction="higher", rel_tol=rel_tol,
           description="our graph decode tok/s over transformers'")
if r.step_ms:  # where the fastest step's kernel time goes
    for kind in ("matrix", "attention", "other"):
        record(f"step_{kind}_ms", r.step_ms[kind], unit="ms", direction="lower", rel_tol=rel_tol,
               description=f"{kind} kernel time of one decode step ({r.profiled})")
    record("step_kernels", r.step_ms["kernels"], unit="kernels", direction="lower", kind="noisy", rel_tol=rel_tol,
           description=f"kernels launched per decode step ({r.profiled}): MoE routing and experts add launches")
record("experts_read_t8", reads.mean, unit="experts", direction="none", kind="exact",
       description="routed experts a verify of 8 tokens reads, mean over MoE layers (a decode token reads top_k)")
record("verify_bytes_over_step", verify_bytes_ratio, unit="x", direction="none", kind="exact",
       description="weight bytes a verify of 8 tokens reads over a decode step's (the experts 8 tokens route to)")
record("weight_gb", r.weight_bytes / 1e9, unit="GB", direction="none",
       description="weight bytes read per decode token, active experts only")
record("cache_bytes_per_token", mini.latent, unit="B", direction="none",
       description="MLA cache bytes per token, all layers (latent + rope key)")
record("cache_ratio", mini.ratio, unit="x", direction="none",
       description="expanded per-head K/V bytes over the latent cache, this shape")
record("kimi_k2_cache_kib_per_token", k2.latent / 1024, unit="KiB", direction="none",
       description="Kimi-K2 MLA cache per token in bf16, all 61 layers (from its config)")
record("kimi_k2_cache_ratio", k2.ratio, unit="x", direction="none",
       description="Kimi-K2: expanded per-head K/V bytes over the latent cache")
