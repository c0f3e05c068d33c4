# %% [markdown]
# # Baseline vs EAGLE-3, eager verify vs graph verify
#
# The game plan's central finding: EAGLE-3 2-step speculation ran at 59-61 tok/s against an 82-83 tok/s baseline,
# because the verify step ran in extend mode without CUDA graphs (~30 ms per cycle). This runbook measures the
# three configurations side by side in one run with the bundled engine: the target alone (decode step in one CUDA
# graph), EAGLE-3 with the verify forward run eagerly (the game plan's slow path, on purpose), and EAGLE-3 with
# every phase captured (drafter steps, drafter extend, tree build, verify). Greedy, batch 1. On CPU nothing is
# captured, so there the two EAGLE-3 rows cost the same and only the speedup from acceptance shows.
#
# Models: target A and drafter A of the miniature K2 world (runbooks train-target and train-drafter, whose outputs
# arrive in `upstream`), or any `target` / `drafter` directories (HF / published EAGLE-3 format). Prompts are the
# held-out prompts train-drafter measures its accept length on, cut to `prompt_len` tokens.
#
# What a cycle costs at a real model's shape (the 8B one), with and without torch.compile, is verify-cost's.
#
# ```yaml
# title: Baseline vs EAGLE-3 (eager verify, graph verify) - tok/s, accept length, cycle ms
# reproduces: [baseline_tok_s, eagle3_tok_s, eagle3_eager_verify_tok_s, speedup, eager_verify_speedup,
#              accept_length, exact_match, exact_match_graph_verify, cycle_ms, eager_verify_cycle_ms,
#              eager_over_graph_cycle]
# feeds: [findings.md, decisions.md, game-plan.md]
# conclusion: "EAGLE-3 with captured verify runs {speedup:.2f}x the baseline, with eager verify {eager_verify_speedup:.2f}x
#   (accept length {accept_length:.2f}, exact greedy match on {exact_match:.0%} of prompts). On a CPU nothing is
#   captured, so the two verify modes cost about the same here; the game plan's slowdown from an eager verify is a
#   GPU effect: `runbook show baseline-eagle3` lists the h200 record (eager verify below the baseline there)."
# depends: [train-target, train-drafter]
# outputs:
#   command: "{python} -m engine generate --target {train-target}/target-a --drafter {train-drafter}/drafter-a
#     --prompt 'def fibonacci(n):' --max-new-tokens 64"
# profiles:
#   cpu: {device: cpu, dtype: float32, n_prompts: 4, prompt_len: 64, new_tokens: 64, repeats: 3, rel_tol: 0.15}
#   h200: {device: cuda, dtype: bfloat16, n_prompts: 8, prompt_len: 128, new_tokens: 256, eager_tokens: 64,
#          repeats: 2, torch_compile: true, rel_tol: 0.15}
#   cpu.dsv3: {device: cpu, dtype: float32, n_prompts: 4, prompt_len: 64, new_tokens: 64, repeats: 3, rel_tol: 0.15}
#   h200.dsv3: {device: cuda, dtype: bfloat16, n_prompts: 8, prompt_len: 128, new_tokens: 256, eager_tokens: 64,
#               repeats: 2, torch_compile: true, rel_tol: 0.15}
# timeout: 3600
# cell_timeout: 2400
# gpu_memory_gib: 12  # on its GPU profiles: the miniature pair, compiled
# ```

# %% tags=["parameters"]
target = ""  # HF-format target directory; empty: target A from train-target
drafter = ""  # EAGLE-3 drafter directory; empty: drafter A from train-drafter
upstream = {}  # injected by `runbook run`: the outputs directory of each runbook in `depends`
device = "cpu"
dtype = "float32"
steps = 7  # draft steps per cycle
topk = 1  # 1: chain; > 1: tree
draft_tokens = 0  # tokens per verify; 0: steps + 1 for a chain, steps * topk + 1 for a tree
n_prompts = 4
prompt_len = 64
new_tokens = 64
eager_tokens = 0  # new tokens of each generation with the verify eager (0: new_tokens): its cycles are launch-bound,
# slow and unsteady, and a short run measures their cost as well
repeats = 3  # timed passes over the prompts; the median pass is recorded
torch_compile = False  # also baseline and EAGLE-3 through torch.compile inside their graphs (compiled_* numbers)
max_seq_len = 512
seed = 0
cpu_threads = 1  # torch threads on CPU: small models on shared cores run fastest on one
rel_tol = 0.15  # floor of the timings' relative tolerance (specbook.record derives it from the samples)

# %%
import torch

from engine.drafter import load_drafter
from engine.loading import load_model, resolve_device, resolve_dtype
from engine.speculate import SpecDecoder
from engine.target_decoder import TargetDecoder
from engine.timing import interleaved_cycle_stats, paired_ratios
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
print(f"target {target_dir} ({tgt.cfg.num_hidden_layers} layers, hidden {tgt.cfg.hidden_size}, vocab "
      f"{tgt.cfg.vocab_size}), drafter {drafter_dir} (feature layers {dft.aux_layers}) on {dev} {dtype}; "
      f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")

# %% [markdown]
# ## Three decoders, one run
#
# Each decoder generates `new_tokens` greedy tokens for every prompt (the eager verify `eager_tokens` where set),
# in `repeats` rounds: every decoder makes one pass over the prompts per round, in an order rotated round by round
# (engine.timing.interleaved_cycle_stats), and a speedup is the median of its rounds' ratios, two passes made back
# to back, so the machine's pace between rounds cancels. The median pass of each decoder is its tok/s.
# A further pass with synchronised phases splits each cycle into draft (drafter extend + draft steps + tree
# build), verify (the target forward and acceptance) and bookkeeping (the host sync, cache compaction).

# %%
n_draft = draft_tokens or None


def decoders(model, drafter, n_draft=None) -> dict:
    """The three decoders, and with torch_compile the baseline and EAGLE-3 again with inductor inside the graphs
    (like against like: a compiled EAGLE-3 is compared with a compiled baseline)."""
    out = {"baseline": lambda: TargetDecoder(model, max_seq_len, cuda_graphs=graphs),
           "eagle3": lambda: SpecDecoder(model, drafter, max_seq_len, steps, topk, n_draft),
           "eagle3_eager_verify": lambda: SpecDecoder(model, drafter, max_seq_len, steps, topk, n_draft,
                                                      eager_verify=True)}
    if torch_compile:
        out["compiled_baseline"] = lambda: TargetDecoder(model, max_seq_len, cuda_graphs=graphs, compile=True)
        out["compiled_eagle3"] = lambda: SpecDecoder(model, drafter, max_seq_len, steps, topk, n_draft, compile=True)
    return out


def measure(model, drafter, prompts, n_draft=None) -> dict:
    made = {name: make() for name, make in decoders(model, drafter, n_draft).items()}
    n_new = {name: eager_tokens or new_tokens if name == "eagle3_eager_verify" else new_tokens for name in made}
    return interleaved_cycle_stats(made, prompts, n_new, repeats, seed)


stats = measure(tgt, dft, prompts, n_draft)


def same_text(names) -> float:
    """Share of prompts on which the named decoders all give the first one's greedy tokens; one that generated fewer
    (the eager verify, `eager_tokens`) is held to them as far as it went."""
    first, *others = (stats[n].token_ids for n in names)
    same = [all(o[i] == first[i][:len(o[i])] for o in others) for i in range(len(first))]
    return sum(same) / len(same)


exact = same_text(stats)
print(f"{'':22}{'tok/s':>9}{'ms/cycle':>10}{'accept':>8}{'draft':>8}{'verify':>8}{'other':>8}")
for name, s in stats.items():
    print(f"{name:22}{s.tok_s:9.1f}{s.ms_per_cycle:10.2f}{s.accept_length:8.2f}{s.draft_ms:8.2f}{s.verify_ms:8.2f}"
          f"{s.other_ms:8.2f}")
print(f"speculative outputs identical to the baseline's: {exact:.0%} of prompts")

# %%
import matplotlib.pyplot as plt

fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
names = list(stats)
a1.bar(names, [stats[n].tok_s for n in names], color=["grey", "tab:green", "tab:red", "silver", "darkgreen"][:len(names)])
a1.set_ylabel("tok/s")
a1.set_title(f"decode speed, {dev.type} {dtype}")
bottom = [0.0] * len(names)
for part, color in (("draft_ms", "tab:blue"), ("verify_ms", "tab:orange"), ("other_ms", "tab:grey")):
    vals = [getattr(stats[n], part) for n in names]
    a2.bar(names, vals, bottom=bottom, color=color, label=part.removesuffix("_ms"))
    bottom = [b + v for b, v in zip(bottom, vals)]
a2.set_ylabel("ms per cycle (synchronised phases)")
a2.legend()
for ax in (a1, a2):
    ax.tick_params(axis="x", labelrotation=20)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Recorded numbers

# %%
b, s, e = stats["baseline"], stats["eagle3"], stats["eagle3_eager_verify"]
what = f"{target_dir.name} + {drafter_dir.name}, {steps} steps, topk {topk}"
record("baseline_tok_s", b.tok_s, unit="tok/s", rel_tol=rel_tol, samples=b.samples,
       description=f"{what}: the target alone, decode step in one CUDA graph")
record("eagle3_tok_s", s.tok_s, unit="tok/s", rel_tol=rel_tol, samples=s.samples,
       description=f"{what}: EAGLE-3, every phase captured")
record("eagle3_eager_verify_tok_s", e.tok_s, unit="tok/s", rel_tol=rel_tol, samples=e.samples,
       description=f"{what}: EAGLE-3 with the verify forward run eagerly (the game plan's slow path), "
                   f"{eager_tokens or new_tokens} new tokens a prompt")


def speedup(num, den) -> dict:
    """The median of the rounds' ratios (each of two passes made back to back), and the ratios as its samples."""
    ratios = paired_ratios(num, den)
    return {"value": sorted(ratios)[len(ratios) // 2], "samples": ratios}


record("speedup", **speedup(s, b), unit="x", rel_tol=rel_tol,
       description=f"{what}: EAGLE-3 over baseline, the median of the rounds' paired ratios")
record("eager_verify_speedup", **speedup(e, b), unit="x", rel_tol=rel_tol,
       description=f"{what}: EAGLE-3 with eager verify over baseline (below 1 is the game plan's regression)")
# greedy acceptance depends only on the models, the prompts and the kernels: the models train deterministically and
# a greedy decode repeats itself on the same hardware and software, so it is exact on every device
given = "exact"
record("accept_length", s.accept_length, unit="tokens/cycle", direction="none", kind=given,
       description=f"{what}: decode tokens per verify cycle, bonus token included")
record("exact_match", exact, unit="fraction", direction="none", kind=given,
       description="prompts on which every decoder (EAGLE-3 with graph or eager verify, compiled or not) gives the "
                   "baseline's greedy output, as far as it generated")
record("exact_match_graph_verify", same_text(["baseline", "eagle3"]), unit="fraction", direction="none", kind=given,
       description="prompts on which EAGLE-3 with graph verify gives the baseline's greedy output")
record("cycle_ms", s.ms_per_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"{what}: wall time per verify cycle")
record("eager_verify_cycle_ms", e.ms_per_cycle, unit="ms", direction="lower", rel_tol=rel_tol,
       description=f"{what}: wall time per verify cycle with eager verify")
record("eager_over_graph_cycle", e.ms_per_cycle / s.ms_per_cycle, unit="x", direction="none", kind="noisy",
       rel_tol=rel_tol,
       description="cycle time with eager verify over cycle time with graph verify")
for part in ("draft_ms", "verify_ms", "other_ms"):
    record(f"cycle_{part}", getattr(s, part), unit="ms", direction="lower", rel_tol=rel_tol,
           description=f"{what}: {part.removesuffix('_ms')} phase per cycle (phases synchronised)")
if torch_compile:
    cb, cs = stats["compiled_baseline"], stats["compiled_eagle3"]
    record("compiled_baseline_tok_s", cb.tok_s, unit="tok/s", rel_tol=rel_tol, samples=cb.samples,
           description=f"{what}: the target alone, decode step through torch.compile inside its graph")
    record("compiled_eagle3_tok_s", cs.tok_s, unit="tok/s", rel_tol=rel_tol, samples=cs.samples,
           description=f"{what}: EAGLE-3, draft steps and verify through torch.compile inside their graphs")
    record("compiled_speedup", **speedup(cs, cb), unit="x", rel_tol=rel_tol,
           description=f"{what}: compiled EAGLE-3 over the compiled baseline")
    record("exact_match_compiled", same_text(["compiled_baseline", "compiled_eagle3"]), unit="fraction",
           direction="none", kind=given,
           description="prompts on which compiled EAGLE-3 gives the compiled baseline's greedy output")
