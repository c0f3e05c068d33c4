# %% [markdown]
# # What a speculation cycle costs, and the accept length it needs to pay off
#
# A speculative cycle is worth it when it emits more tokens than the baseline could decode in the same time:
# with a cycle of C ms and a decode step of D ms, the break-even accept length is C / D. This runbook measures
# chains of k draft steps (a verify of k + 1 tokens; the lengths in `chains`, else k = 1..`max_steps`) and a few
# trees (topk > 1 with a budget of draft tokens): draft, verify and bookkeeping per cycle against a baseline decode
# step, and the break-even accept length with the verify forward captured in a CUDA graph, and for `eager_configs`
# (the game plan's 2-step chain, SGLang's 7-step one) with it run eagerly. With `torch_compile` (h200) the decode
# step and the `chain_steps` chain also run through torch.compile inside their graphs; the chain's phases and the
# speedup it projects at `accept_length` tokens per cycle (SGLang's H200 MT-bench accept length) are recorded both
# ways.
#
# The game plan's regression in these terms: an eager verify made its 2-step cycle cost ~30 ms, far above what an
# accept length of 2-3 could pay for. Drafter and target are random weights of `shape` (speed does not depend on
# the values); a random drafter is rejected almost always, so every cycle's draft-extend is one token long.
#
# ```yaml
# title: Verify cost - draft, verify and cycle ms vs a decode step; break-even accept length, eager vs graph
# reproduces: [decode_step_ms, breakeven.k7, eager_breakeven.k7, verify_over_step.k7, projected_speedup.k7]
# feeds: [findings.md]
# depends: []
# profiles:
#   cpu: {shape: tiny, device: cpu, dtype: float32, max_steps: 8, trees: [[3, 2, 6], [4, 4, 12]], prompt_len: 16,
#         new_tokens: 32, repeats: 3, rel_tol: 0.15}
#   h200: {shape: llama-3.1-8b, device: cuda, dtype: bfloat16, chains: [2, 7], trees: [[7, 8, 64]],
#          prompt_len: 128, new_tokens: 64, eager_tokens: 16, repeats: 2, max_seq_len: 384, torch_compile: true,
#          rel_tol: 0.15}
# timeout: 3600
# cell_timeout: 3000
# gpu_memory_gib: 24  # on its GPU profiles: the 8B shape's weights and a drafter
# ```

# %% tags=["parameters"]
shape = "tiny"
device = "cpu"
dtype = "float32"
max_steps = 8  # chains of 1 to max_steps draft steps, unless `chains` names the lengths
chains = []  # the chain lengths k measured (empty: 1..max_steps): those the docs compare, on a lease's clock
trees = [[3, 2, 6], [4, 4, 12]]  # [steps, topk, draft_tokens] of each tree
prompt_len = 16
new_tokens = 32
eager_configs = ["k2", "k7"]  # chains (kN) or trees (treeKxTnN) also timed with the verify eager: the host's launch
# pace, which is slow and unsteady, so only where the docs need it
eager_tokens = 0  # new tokens of each eager-verify generation (0: new_tokens)
chain_steps = 7  # the chain whose phases and projected speedup are recorded (SGLang's setting)
accept_length = 3.86  # tokens per cycle of the projection: SGLang's H200 MT-bench accept length for that chain
torch_compile = False  # also the decode step and the chain_steps chain through torch.compile inside their graphs
repeats = 3
max_seq_len = 512  # KV-cache length; at baseline-decode's (h200: 384) inductor's on-disk cache can serve the decode
# step's compile from that runbook's
seed = 0
cpu_threads = 1  # torch threads on CPU: small models on shared cores run fastest on one
rel_tol = 0.15  # floor of the timings' relative tolerance (specbook.record derives it from the samples)

# %%
import gc

import torch

from engine.drafter import new_drafter
from engine.loading import random_model, resolve_device, resolve_dtype
from engine.metrics import breakeven, in_decode_steps, projected_speedup
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from engine.timing import cycle_stats
from specbook import record

dev, dt = resolve_device(device), resolve_dtype(dtype)
if dev.type == "cpu" and cpu_threads:
    torch.set_num_threads(cpu_threads)
graphs = dev.type == "cuda"
tgt = random_model(shape, dev, dt, seed=seed)
dft = new_drafter(tgt.cfg, torch.arange(min(32000, tgt.cfg.vocab_size)), embedding=tgt.embed_tokens, seed=seed,
                  device=dev, dtype=dt)
g = torch.Generator().manual_seed(seed)
prompts = [torch.randint(0, tgt.cfg.vocab_size, (prompt_len,), generator=g).tolist()]
step_ms = cycle_stats(TargetDecoder(tgt, max_seq_len, cuda_graphs=graphs), prompts, new_tokens, repeats, seed).ms_per_cycle
print(f"{shape} on {dev} {dtype}: baseline decode step {step_ms:.2f} ms")

# %%
ks = sorted(chains) or list(range(1, max_steps + 1))
configs = [(f"k{k}", k, 1, k + 1) for k in ks]
configs += [(f"tree{k}x{K}n{n}", k, K, n) for k, K, n in trees]
if unknown := sorted((set(eager_configs) | {f"k{chain_steps}"}) - {c[0] for c in configs}):
    raise ValueError(f"{unknown}: not among the measured configurations (eager_configs, chain_steps, chains or "
                     "max_steps)")
rows = {}


def cycles(decoder, n_new: int = new_tokens):
    st = cycle_stats(decoder, prompts, n_new, repeats, seed)
    gc.collect()  # a decoder's graphs hold device memory; free them before capturing the next
    if graphs:
        torch.cuda.empty_cache()
    return st


for name, k, K, n in configs:
    rows[name, "graph"] = cycles(SpecDecoder(tgt, dft, max_seq_len, k, K, n))
    if name in eager_configs:
        rows[name, "eager"] = cycles(SpecDecoder(tgt, dft, max_seq_len, k, K, n, eager_verify=True),
                                     eager_tokens or new_tokens)
compiled = None
if torch_compile:  # like against like: the compiled chain against the compiled decode step
    compiled = (cycles(TargetDecoder(tgt, max_seq_len, cuda_graphs=graphs, compile=True)).ms_per_cycle,
                cycles(SpecDecoder(tgt, dft, max_seq_len, chain_steps, 1, chain_steps + 1, compile=True)))
table = {**rows, **({(f"k{chain_steps}", "compiled"): compiled[1]} if compiled else {})}
print(f"{'':16}{'mode':>9}{'cycle':>8}{'draft':>8}{'verify':>8}{'other':>8}{'break-even':>12}")
for (name, mode), st in table.items():
    step = compiled[0] if mode == "compiled" else step_ms
    print(f"{name:16}{mode:>9}{st.ms_per_cycle:8.2f}{st.draft_ms:8.2f}{st.verify_ms:8.2f}{st.other_ms:8.2f}"
          f"{breakeven(st.ms_per_cycle, step):12.2f}")
if compiled:
    print(f"compiled decode step {compiled[0]:.2f} ms")

# %%
import matplotlib.pyplot as plt

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
a1.plot(ks, [breakeven(rows[f"k{k}", "graph"].ms_per_cycle, step_ms) for k in ks], "-o", label="chain, graph verify")
for name, k, K, n in configs[len(ks):]:
    a1.plot([k], [breakeven(rows[name, "graph"].ms_per_cycle, step_ms)], "^", label=f"tree topk {K}, {n} tokens")
for name, k, K, n in configs:
    if (name, "eager") in rows:
        a1.plot([k], [breakeven(rows[name, "eager"].ms_per_cycle, step_ms)], "s", color="tab:red",
                label="eager verify" if name == eager_configs[0] else None)
if compiled:
    a1.plot([chain_steps], [breakeven(compiled[1].ms_per_cycle, compiled[0])], "*", ms=12, color="tab:purple",
            label="compiled chain / compiled step")
a1.plot(ks, [k + 1 for k in ks], ":", color="grey", label="most a chain can emit (k + 1)")
a1.axhline(accept_length, color="tab:green", lw=0.8, label=f"SGLang H200 MT-bench accept length {accept_length}")
a1.set_xlabel("draft steps k")
a1.set_ylabel("break-even accept length (cycle / decode step)")
a1.legend(fontsize=7)
for part, color in (("draft_ms", "tab:blue"), ("verify_ms", "tab:orange"), ("other_ms", "tab:grey")):
    a2.plot(ks, [in_decode_steps(getattr(rows[f"k{k}", "graph"], part), step_ms) for k in ks], "-o", color=color,
            label=f"{part.removesuffix('_ms')} (graph verify)")
a2.set_xlabel("draft steps k")
a2.set_ylabel("ms per cycle / ms per decode step")
a2.legend(fontsize=7)
plt.suptitle(f"{shape}, {dev.type} {dtype}")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Recorded numbers
# `breakeven.<config>` is cycle ms over decode-step ms: the accept length a drafter must reach for speculation to
# match the baseline. `verify_over_step.<config>` is the verify forward of k + 1 (or n) tokens over a decode step.

# %%
record("decode_step_ms", step_ms, unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"{shape}: one baseline decode step")
for name, k, K, n in configs:
    gr = rows[name, "graph"]
    what = f"{shape}: {k} draft steps, topk {K}, {n} tokens verified"
    record(f"cycle_ms.{name}", gr.ms_per_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{what}, graph verify")
    record(f"breakeven.{name}", breakeven(gr.ms_per_cycle, step_ms), unit="tokens/cycle", direction="lower",
           rel_tol=rel_tol, description=f"{what}: break-even accept length, graph verify")
    record(f"verify_over_step.{name}", in_decode_steps(gr.verify_ms, step_ms), unit="x", direction="lower",
           rel_tol=rel_tol, description=f"{what}: verify forward over a decode step (phases synchronised)")
    if (name, "eager") in rows:
        record(f"eager_breakeven.{name}", breakeven(rows[name, "eager"].ms_per_cycle, step_ms), unit="tokens/cycle",
               direction="lower", rel_tol=rel_tol, description=f"{what}: break-even accept length, eager verify")


def record_chain(prefix: str, st, step: float, how: str) -> None:
    """The chain_steps chain's phases and the speedup it projects, against a decode step of the same kind. The
    bookkeeping phase (cycle minus draft and verify) is printed, not recorded: a tenth of a millisecond, its relative
    noise is large and says nothing the cycle does not."""
    sfx, what = f".k{chain_steps}", f"{shape}: chain of {chain_steps} draft steps ({how})"
    for part in ("draft_ms", "verify_ms"):
        record(f"{prefix}{part}{sfx}", getattr(st, part), unit="ms", direction="lower", rel_tol=rel_tol,
               description=f"{what}: {part.removesuffix('_ms')} phase of a cycle (phases synchronised)")
    record(f"{prefix}projected_speedup{sfx}", projected_speedup(accept_length, st.ms_per_cycle, step), unit="x",
           rel_tol=rel_tol, description=f"{what}: tok/s at {accept_length} tokens per cycle over the baseline's")


record_chain("", rows[f"k{chain_steps}", "graph"], step_ms, "CUDA graphs")
if compiled:
    cstep, cst = compiled
    record("compiled_decode_step_ms", cstep, unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{shape}: one baseline decode step, torch.compile inside the graph")
    record(f"compiled_cycle_ms.k{chain_steps}", cst.ms_per_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{shape}: chain of {chain_steps}, draft steps and verify through torch.compile in their graphs")
    record(f"compiled_breakeven.k{chain_steps}", breakeven(cst.ms_per_cycle, cstep), unit="tokens/cycle",
           direction="lower", rel_tol=rel_tol,
           description=f"{shape}: compiled chain cycle over compiled decode step (SGLang on an H200: ~1.6)")
    record_chain("compiled_", cst, cstep, "torch.compile inside the graphs")
