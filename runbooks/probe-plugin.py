# %% [markdown]
# # Approach C: does drafter A plug into target B?
#
# The game plan's cheapest experiment: before fine-tuning anything, check whether the new target's hidden states
# still look like the old one's, and how much accept length the old drafter keeps on the new target. Here:
#
# 1. per-layer cosine similarity between target A's and target B's residual streams on the same held-out prompts
#    (the three layers EAGLE-3 reads are marked);
# 2. drafter A's accept length on target A and, plugged in unchanged (with B's embedding table), on target B.
#
# `-p target=DIR -p target_b=DIR -p drafter=DIR` run the probe on real checkpoints (e.g. Kimi-K2, Kimi-K2.5 and
# the AQ-MedAI K2 drafter).
#
# ```yaml
# title: Approach C - hidden-state similarity of A and B per layer; drafter A's accept length on B vs on A
# reproduces: [cos_aux_mean, cos_min, accept_on_a, accept_on_b, accept_kept]
# feeds: [game-plan.md]
# depends: [train-target, train-drafter]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda, accept_tol: 0.05, cos_tol: 0.01}
#   cpu.dsv3: {preset: cpu, device: cpu}
#   h200.dsv3: {preset: gpu, device: cuda, accept_tol: 0.05, cos_tol: 0.01}
# timeout: 1800
# cell_timeout: 1500
# ```

# %% tags=["parameters"]
preset = "cpu"
device = "cpu"
chain_steps = 7
eval_prompts: int | None = None  # held-out prompts [default: the preset's]
max_new_tokens: int | None = None
mix = "A"  # the held-out prompts' mix (A: the drafter's own kind of data)
target: str | None = None  # target A [default: train-target's target-a]
target_b: str | None = None  # target B [default: train-target's target-b]
drafter: str | None = None  # drafter A [default: train-drafter's drafter-a]
threads = 2
cos_tol = 1e-4  # relative tolerance of the cosines: exact on CPU; a GPU profile sets its own
accept_tol = 0.0  # accept lengths: exact on CPU; GPU training is not bit-reproducible, so a GPU profile sets one
upstream: dict = {}

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from engine.drafter import load_drafter
from engine.loading import load_model
from engine.train.drafter import accept_length, check_pair, prompt_ids
from engine.train.presets import get_preset
from engine.train.tokenizer import load_tokenizer
from specbook import record

torch.set_num_threads(threads)
torch.manual_seed(0)
p = get_preset(preset)
dir_a = Path(target or Path(upstream["train-target"]) / "target-a")
dir_b = Path(target_b or Path(upstream["train-target"]) / "target-b")
dir_d = Path(drafter or Path(upstream["train-drafter"]) / "drafter-a")
for d in (dir_a, dir_b):
    check_pair(d, dir_d)
model_a = load_model(dir_a, device=device, dtype=p.dtype)
model_b = load_model(dir_b, device=device, dtype=p.dtype)
prompts = prompt_ids(load_tokenizer(dir_a), eval_prompts or p.eval_prompts, p.prompt_chars, mix)

# %% [markdown]
# ## Hidden states, layer by layer
#
# Layer i below is the residual stream entering layer i (0 = the embeddings, L = the last layer's output), on
# every token of every prompt; the similarity is averaged over tokens.

# %%
L = model_a.cfg.num_hidden_layers
layers = tuple(range(L + 1))


@torch.no_grad()
def states(model, ids):
    x = torch.tensor([ids], device=model.device)
    _, aux = model(x, torch.arange(len(ids), device=model.device), hidden_layers=layers)
    return aux.float().view(len(ids), L + 1, -1)  # [T, layers, H]


sums = torch.zeros(L + 1)
tokens = 0
for ids in prompts:
    sums += torch.nn.functional.cosine_similarity(states(model_a, ids), states(model_b, ids), dim=-1).sum(0).cpu()
    tokens += len(ids)
cos = (sums / tokens).tolist()
aux_layers = load_drafter(dir_d, model_a).aux_layers

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(layers, cos, marker="o")
ax.set_xticks(layers[:: max(1, len(layers) // 16)])
for i in aux_layers:
    ax.axvline(i, color="tab:red", alpha=0.4)
ax.set_xlabel("residual stream entering layer (red: the drafter's feature layers)")
ax.set_ylabel("cosine(A, B), mean over tokens")
ax.set_ylim(min(cos) - 0.05, 1.0)
plt.show()
print("cosine per layer:", [round(c, 4) for c in cos])

# %% [markdown]
# ## Drafter A on A and on B

# %%
new_tokens = max_new_tokens or p.max_new_tokens
tau = {}
for name, model in (("A", model_a), ("B", model_b)):
    tau[name] = accept_length(model, load_drafter(dir_d, model), prompts, chain_steps, new_tokens)
    print(f"drafter A on target {name}: accept length {tau[name]:.3f}")

# %%
kind = "exact" if device == "cpu" else "noisy"  # GPU training is not bit-reproducible: its results are noisy
record("cos_aux_mean", sum(cos[i] for i in aux_layers) / 3, unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
       description="A-vs-B cosine similarity at the drafter's three feature layers, mean")
record("cos_min", min(cos), unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
       description="lowest A-vs-B cosine similarity over layers")
record("accept_on_a", tau["A"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"drafter A on target A, greedy chain of {chain_steps}, held-out prompts of mix {mix}")
record("accept_on_b", tau["B"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"drafter A plugged into target B unchanged, same prompts")
record("accept_kept", (tau["B"] - 1) / max(tau["A"] - 1, 1e-9), unit="fraction", kind=kind, direction="higher",
       rel_tol=accept_tol, description="share of drafter A's accepted draft tokens per cycle that survive on B")
