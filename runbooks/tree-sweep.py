# %% [markdown]
# # Tree shapes: which [steps, topk, draft tokens] pays most, greedy and sampled; deterministic mode's cost
#
# A tree verifies more draft tokens per cycle than a chain and so accepts more of them, but its verify forward and
# its draft steps cost more. Which shape wins depends on the drafter (how often its second and third choices are
# right) and on how a verify's cost grows with its token count. This runbook measures it on the trained pair of the
# miniature K2 world (target A from train-target, drafter A from train-drafter): the compiled baseline and compiled
# EAGLE-3 for each shape in `shapes` ([steps, topk, draft_tokens]; topk 1 is a chain), greedy, batch 1, with accept
# length, tok/s, speedup over the compiled baseline and cycle ms per shape; the best shape's speedup; the same for the
# chain and the best tree when sampling at temperature `temperature` (rejection sampling, seeded, so CPU accept
# lengths are exact); and the deterministic mode (engine.deterministic: every target forward of the decode loop at
# the chain's verify width, so verify and decode round alike) against the fast mode for the chain.
#
# The cost side on its own is verify-cost's: its h200 profile measures the cycle at the llama-3.1-8b shape for chains
# of 1-8 steps (verifies of 2-9 tokens) and trees of 16, 32 and 64 draft tokens ([4, 4, 16], [6, 4, 32],
# [7, 8, 64]), i.e. the verify widths this sweep's trees use at that scale.
#
# ```yaml
# title: Tree sweep - speedup per tree shape (greedy, sampled), best shape, deterministic mode's cost
# reproduces: [best_speedup, best_accept_length, baseline_tok_s, speedup.k7x1n8, accept_length.k7x1n8,
#              chain_sampled_speedup, tree_sampled_speedup, deterministic_exact_match, deterministic_tok_s,
#              deterministic_over_fast, exact_match_fast]
# feeds: [findings.md]
# conclusion: "The best shape runs {best_speedup:.2f}x the compiled baseline at accept length {best_accept_length:.2f}
#   (`runbook show tree-sweep`: the description names the shape); sampling at the runbook's temperature, the chain
#   runs {chain_sampled_speedup:.2f}x and the best tree {tree_sampled_speedup:.2f}x. Deterministic mode matches
#   the baseline on {deterministic_exact_match:.0%} of prompts (fast mode {exact_match_fast:.0%}) at
#   {deterministic_over_fast:.2f}x the fast chain's tok/s."
# depends: [train-target, train-drafter]
# profiles:
#   cpu: {device: cpu, dtype: float32, shapes: [[7, 1, 8], [3, 1, 4], [3, 2, 6], [4, 4, 12]], n_prompts: 2,
#         prompt_len: 64, new_tokens: 48, repeats: 3, rel_tol: 0.15}
#   h200: {device: cuda, dtype: bfloat16, torch_compile: true,
#          shapes: [[7, 1, 8], [10, 1, 11], [7, 2, 16], [8, 4, 32], [7, 8, 64]],
#          n_prompts: 8, prompt_len: 128, new_tokens: 256, repeats: 2, rel_tol: 0.15}
# timeout: 3600
# cell_timeout: 2400
# gpu_memory_gib: 12  # on its GPU profiles: the miniature pair, trees of up to 64 tokens
# ```

# %% tags=["parameters"]
target = ""  # HF-format target directory; empty: target A from train-target
drafter = ""  # EAGLE-3 drafter directory; empty: drafter A from train-drafter
upstream = {}  # injected by `runbook run`: the outputs directory of each runbook in `depends`
device = "cpu"
dtype = "float32"
shapes = [[7, 1, 8], [3, 1, 4], [3, 2, 6], [4, 4, 12]]  # [steps, topk, draft_tokens]; the first chain is "the chain"
temperature = 0.7  # the sampled runs (chain and best tree); top-k and top-p off
n_prompts = 2
prompt_len = 64
new_tokens = 48
repeats = 3  # timed passes over the prompts; the median pass is recorded
torch_compile = False  # baseline and EAGLE-3 through torch.compile inside their CUDA graphs
max_seq_len = 512
seed = 0
cpu_threads = 1  # torch threads on CPU: small models on shared cores run fastest on one
rel_tol = 0.15  # floor of the timings' relative tolerance (specbook.record derives it from the samples)

# %%
import gc

import torch

from engine.deterministic import Deterministic
from engine.drafter import load_drafter
from engine.loading import load_model, resolve_device, resolve_dtype
from engine.sampling import SamplingParams
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from engine.timing import CycleStats, interleaved_cycle_stats, paired_ratios
from engine.train.drafter import held_out_prompts
from engine.train.layout import trained_pair_dirs
from engine.train.tokenizer import load_tokenizer
from specbook import record

dev, dt = resolve_device(device), resolve_dtype(dtype)
if dev.type == "cpu" and cpu_threads:
    torch.set_num_threads(cpu_threads)
graphs = dev.type == "cuda"
target_dir, drafter_dir = trained_pair_dirs(target, drafter, upstream)
tgt = load_model(target_dir, dev, dt)
dft = load_drafter(drafter_dir, tgt, dev, dt)
prompts = [p[:prompt_len] for p in held_out_prompts(load_tokenizer(target_dir), n_prompts, 8 * prompt_len, "A")]
shapes = [tuple(s) for s in shapes]
chains = [s for s in shapes if s[1] == 1]
if not chains or len(chains) == len(shapes):
    raise ValueError(f"shapes needs a chain (topk 1) and at least one tree, got {shapes}")
chain = chains[0]
print(f"target {target_dir} ({tgt.cfg.num_hidden_layers} layers, hidden {tgt.cfg.hidden_size}), drafter "
      f"{drafter_dir} on {dev} {dtype}, compiled: {torch_compile}; {len(prompts)} prompts of {prompt_len} tokens, "
      f"{new_tokens} new; shapes {shapes}")


# %% [markdown]
# ## Greedy: the compiled baseline and every shape
#
# The baseline and every shape take turns: in each of `repeats` rounds every decoder makes one pass over the prompts
# (`new_tokens` tokens each), in an order rotated round by round (engine.timing.interleaved_cycle_stats, as
# baseline-eagle3 measures). A speedup is the median of the rounds' ratios, two passes made back to back, so a change
# of the machine's pace between passes cancels; each decoder's median pass is its tok/s. A further pass with
# synchronised phases gives cycle ms.

# %%
def label(shape: tuple[int, int, int]) -> str:
    k, K, n = shape
    return f"k{k}x{K}n{n}"


def measure(makers: dict, sampling: SamplingParams = SamplingParams()) -> dict[str, CycleStats]:
    """The named decoders measured in interleaved rounds; their graphs are freed before the next group captures."""
    stats = interleaved_cycle_stats({name: make() for name, make in makers.items()}, prompts, new_tokens, repeats,
                                    seed, sampling)
    gc.collect()
    if graphs:
        torch.cuda.empty_cache()
    return stats


def paired(num: CycleStats, den: CycleStats) -> dict:
    """A speedup: the median of the rounds' ratios (each of two passes made back to back), the ratios its samples."""
    ratios = paired_ratios(num, den)
    return {"value": sorted(ratios)[len(ratios) // 2], "samples": ratios}


def baseline(**kw) -> TargetDecoder:
    return TargetDecoder(tgt, max_seq_len, cuda_graphs=graphs, compile=torch_compile, **kw)


def spec(shape: tuple[int, int, int], **kw) -> SpecDecoder:
    k, K, n = shape
    return SpecDecoder(tgt, dft, max_seq_len, k, K, n, compile=torch_compile, **kw)


swept = measure({"baseline": baseline, **{label(s): lambda s=s: spec(s) for s in shapes}})
base = swept["baseline"]
greedy = {s: swept[label(s)] for s in shapes}


def same_tokens(a: CycleStats, b: CycleStats) -> float:
    """Share of prompts on which two decoders give the same tokens."""
    return sum(x == y for x, y in zip(a.token_ids, b.token_ids)) / len(prompts)


def speedup(s: tuple[int, int, int]) -> float:
    return paired(greedy[s], base)["value"]


best = max(shapes, key=speedup)
best_tree = max((s for s in shapes if s[1] > 1), key=speedup)
print(f"{'':14}{'tok/s':>9}{'speedup':>9}{'accept':>8}{'ms/cycle':>10}{'same as baseline':>18}")
print(f"{'baseline':14}{base.tok_s:9.1f}{1:9.2f}{base.accept_length:8.2f}{base.ms_per_cycle:10.2f}")
for s, st in greedy.items():
    print(f"{label(s):14}{st.tok_s:9.1f}{speedup(s):9.2f}{st.accept_length:8.2f}{st.ms_per_cycle:10.2f}"
          f"{same_tokens(st, base):18.0%}")
print(f"best: {label(best)} ({speedup(best):.2f}x); best tree: {label(best_tree)} ({speedup(best_tree):.2f}x)")

# %% [markdown]
# ## Sampled: the chain and the best tree at `temperature`
#
# Rejection sampling keeps the target's distribution, so the baseline samples at the same temperature; every
# generation is seeded (`seed`), so on CPU the tokens and accept lengths repeat exactly. The chain draws its drafts
# from the drafter's distribution at that temperature and accepts by speculative sampling (a draft kept with
# probability 1 - TV(p, q) on average); trees keep their top-k drafts (engine.runners says why).

# %%
sampling = SamplingParams(temperature=temperature)
drawn = measure({"baseline": baseline, **{label(s): lambda s=s: spec(s) for s in (chain, best_tree)}}, sampling)
sampled_base = drawn["baseline"]
sampled = {s: drawn[label(s)] for s in (chain, best_tree)}
for s, st in sampled.items():
    print(f"T={temperature} {label(s):12} {st.tok_s:9.1f} tok/s, {paired(st, sampled_base)['value']:.2f}x the sampled "
          f"baseline ({sampled_base.tok_s:.1f} tok/s), accept length {st.accept_length:.2f} "
          f"(greedy {greedy[s].accept_length:.2f})")

# %% [markdown]
# ## Deterministic mode against the fast mode (chain)
#
# In the fast mode (the default) the baseline decodes one token per forward and the verify runs steps + 1, so in
# bfloat16 the two round differently and greedy outputs can part at a near-tie. The deterministic mode runs the
# baseline's decode step at the verify's width (its token plus padding rows), so every target forward has one shape
# and a position's logits are bit-identical in both; its cost is the padded decode step and a verify compiled apart
# from its acceptance logic.

# %%
mode = Deterministic.chain(chain[0], dft)
# the fast chain and baseline again, in the same rounds, so that the deterministic mode's cost is a paired ratio too
det = measure({"baseline": lambda: baseline(deterministic=mode), "chain": lambda: spec(chain, deterministic=True),
               "fast_chain": lambda: spec(chain), "fast_baseline": baseline})
det_base, det_spec = det["baseline"], det["chain"]
det_cost = paired(det_spec, det["fast_chain"])
det_match, fast_match = same_tokens(det_spec, det_base), same_tokens(greedy[chain], base)
print(f"deterministic: baseline {det_base.tok_s:.1f} tok/s, {label(chain)} {det_spec.tok_s:.1f} tok/s "
      f"({det_cost['value']:.2f}x the fast chain); same tokens as its baseline on {det_match:.0%} "
      f"of prompts (fast mode: {fast_match:.0%})")

# %%
import matplotlib.pyplot as plt

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
for s in shapes:
    color = "tab:blue" if s[1] == 1 else "tab:green"
    for ax, x in ((a1, s[2]), (a2, greedy[s].accept_length)):
        ax.plot([x], [speedup(s)], "o", color=color)
        ax.annotate(label(s), (x, speedup(s)), fontsize=7, xytext=(3, 3), textcoords="offset points")
for s, st in sampled.items():
    for ax, x in ((a1, s[2]), (a2, st.accept_length)):
        ax.plot([x], [paired(st, sampled_base)["value"]], "x", color="tab:red")
a1.plot([], [], "o", color="tab:blue", label="chain, greedy")
a1.plot([], [], "o", color="tab:green", label="tree, greedy")
a1.plot([], [], "x", color="tab:red", label=f"sampled, T={temperature}")
a1.set_xscale("log", base=2)
a1.set_xlabel("draft tokens per verify")
a2.set_xlabel("accept length (tokens per cycle)")
for ax in (a1, a2):
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup over the compiled baseline" if torch_compile else "speedup over the baseline")
a1.legend(fontsize=7)
plt.suptitle(f"{target_dir.name} + {drafter_dir.name}, {dev.type} {dtype}, greedy batch 1")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Recorded numbers
# Per shape (`<label>` = k<steps>x<topk>n<draft tokens>): `accept_length.<label>`, `tok_s.<label>`,
# `speedup.<label>` over the (compiled) baseline, `cycle_ms.<label>`.

# %%
what = f"{target_dir.name} + {drafter_dir.name}, greedy, batch 1" + (", compiled" if torch_compile else "")
# greedy acceptance depends only on the models, the prompts and the kernels: the models train deterministically and
# a greedy decode repeats itself on the same hardware and software, so it is exact on every device
given = "exact"


def tol(kind: str) -> dict:
    """An exact number's tolerance is specbook's own; a noisy one's floor is rel_tol."""
    return {"kind": kind} if kind == "exact" else {"kind": kind, "rel_tol": rel_tol}


record("baseline_tok_s", base.tok_s, unit="tok/s", rel_tol=rel_tol, samples=base.samples,
       description=f"{what}: the target alone")
for s in shapes:
    st, name, how = greedy[s], label(s), f"{what}: {s[0]} steps, topk {s[1]}, {s[2]} draft tokens"
    record(f"accept_length.{name}", st.accept_length, unit="tokens/cycle", direction="none", **tol(given),
           description=f"{how}: decode tokens per verify cycle, bonus token included")
    record(f"tok_s.{name}", st.tok_s, unit="tok/s", rel_tol=rel_tol, samples=st.samples, description=how)
    record(f"speedup.{name}", **paired(st, base), unit="x", rel_tol=rel_tol,
           description=f"{how}: over the baseline, the median of the rounds' paired ratios")
    record(f"cycle_ms.{name}", st.ms_per_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{how}: wall time per verify cycle")
record("best_speedup", **paired(greedy[best], base), unit="x", rel_tol=rel_tol,
       description=f"{what}: the fastest shape of the sweep, {label(best)} ({best[0]} steps, topk {best[1]}, "
                   f"{best[2]} draft tokens), over the baseline")
# which shape wins is itself a timing result, so its accept length is noisy even on CPU
record("best_accept_length", greedy[best].accept_length, unit="tokens/cycle", direction="none", **tol("noisy"),
       description=f"{what}: accept length of the fastest shape, {label(best)}")

sampled_what = f"{target_dir.name} + {drafter_dir.name}, temperature {temperature}, seed {seed}, batch 1"
record("sampled_baseline_tok_s", sampled_base.tok_s, unit="tok/s", rel_tol=rel_tol, samples=sampled_base.samples,
       description=f"{sampled_what}: the target alone")
for key, s in (("chain", chain), ("tree", best_tree)):
    st = sampled[s]
    record(f"{key}_sampled_speedup", **paired(st, sampled_base), unit="x", rel_tol=rel_tol,
           description=f"{sampled_what}: {label(s)} over the sampled baseline")
    # the chain is a parameter (exact on CPU); the best tree is picked by a timing (noisy everywhere)
    record(f"{key}_sampled_accept_length", st.accept_length, unit="tokens/cycle", direction="none",
           **tol(given if key == "chain" else "noisy"),
           description=f"{sampled_what}: {label(s)}, decode tokens per verify cycle")

det_what = f"{target_dir.name} + {drafter_dir.name}, {label(chain)}, greedy" + (", compiled" if torch_compile else "")
# equal tokens by construction in deterministic mode, whatever the models: exact on every profile
record("deterministic_exact_match", det_match, unit="fraction", direction="none", **tol("exact"),
       description=f"{det_what}: prompts on which deterministic EAGLE-3 gives the deterministic baseline's tokens")
record("exact_match_fast", fast_match, unit="fraction", direction="none", **tol(given),
       description=f"{det_what}: prompts on which fast-mode EAGLE-3 gives the fast baseline's tokens")
record("deterministic_tok_s", det_spec.tok_s, unit="tok/s", rel_tol=rel_tol, samples=det_spec.samples,
       description=f"{det_what}: deterministic EAGLE-3")
record("deterministic_baseline_tok_s", det_base.tok_s, unit="tok/s", rel_tol=rel_tol, samples=det_base.samples,
       description=f"{det_what}: the deterministic baseline (decode step at the verify's width)")
record("deterministic_over_fast", **det_cost, unit="x", rel_tol=rel_tol,
       description=f"{det_what}: deterministic EAGLE-3 tok/s over fast-mode EAGLE-3 tok/s (1 = free)")
record("deterministic_speedup", **paired(det_spec, det["fast_baseline"]), unit="x", rel_tol=rel_tol,
       description=f"{det_what}: deterministic EAGLE-3 over the fast baseline")
