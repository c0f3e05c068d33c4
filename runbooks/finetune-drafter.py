# %% [markdown]
# # Approach A: fine-tune drafter A on a small sample of B's data
#
# The game plan's second step: start from the K2 drafter (trained on 1.4M samples) and fine-tune it with the 37K
# K2.5 samples at hand. In miniature: drafter A is trained further against target B on a small set of sequences
# (`samples`: prompts from mix B answered by target B), its draft vocabulary kept; accept length on B's held-out
# prompts is measured as training goes (step 0 = plugged in unchanged, approach C's number).
#
# `-p target=DIR -p drafter=DIR` fine-tune a real drafter for a real target (DIR = the NEW target).
#
# ```yaml
# title: Approach A - drafter A fine-tuned on a small sample of mix B; accept length on target B against steps
# reproduces: [accept_before, accept_after, accept_gain]
# feeds: [game-plan.md]
# depends: [train-target, train-drafter]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda, samples: 2048, loss_tol: 0.02, accept_tol: 0.05}
#   cpu.dsv3: {preset: cpu, device: cpu}
#   h200.dsv3: {preset: gpu, device: cuda, samples: 2048, loss_tol: 0.02, accept_tol: 0.05}
# timeout: 3600
# cell_timeout: 3000
# ```

# %% tags=["parameters"]
preset = "cpu"
device = "cpu"
samples = 64  # training sequences from mix B, answered by target B (the game plan's "37K samples", scaled down)
steps: int | None = None  # override the preset's fine-tuning steps
eval_every: int | None = None  # steps between accept-length measurements [default: steps // 4]
chain_steps = 7
eval_prompts: int | None = None
max_new_tokens: int | None = None
target: str | None = None  # the new target [default: train-target's target-b]
drafter: str | None = None  # the drafter to start from [default: train-drafter's drafter-a]
threads = 2
loss_tol = 1e-4  # relative tolerance of the losses: exact on CPU (fixed seeds, pinned corpus); GPUs set one
accept_tol = 0.0  # accept lengths: exact on CPU; GPU training is not bit-reproducible, so a GPU profile sets one
outputs_dir: str | None = None
upstream: dict = {}

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from engine.drafter import load_drafter
from engine.loading import load_model
from engine.train.drafter import accept_length, check_pair, prompt_ids, train_drafter
from engine.train.presets import get_preset, with_overrides
from engine.train.tokenizer import load_tokenizer
from specbook import record

torch.set_num_threads(threads)
torch.manual_seed(0)
out = Path(outputs_dir or tempfile.mkdtemp(prefix="finetune-drafter-"))
p = get_preset(preset)
run = with_overrides(p.finetune, steps=steps, samples=samples)
every = eval_every or max(run.steps // 4, 1)
dir_b = Path(target or Path(upstream["train-target"]) / "target-b")
dir_d = Path(drafter or Path(upstream["train-drafter"]) / "drafter-a")
check_pair(dir_b, dir_d)
prompts = prompt_ids(load_tokenizer(dir_b), eval_prompts or p.eval_prompts, p.prompt_chars, "B")
new_tokens = max_new_tokens or p.max_new_tokens


def measure(draft, model) -> dict[str, float]:
    return {"accept_length": accept_length(model, draft, prompts, chain_steps, new_tokens)}


# %% [markdown]
# ## Before: drafter A plugged into B unchanged

# %%
model_b = load_model(dir_b, device=device, dtype=p.dtype)
before = measure(load_drafter(dir_d, model_b), model_b)["accept_length"]
print(f"accept length on B before fine-tuning: {before:.3f}")
del model_b

# %% [markdown]
# ## Fine-tuning on the small sample

# %%
res = train_drafter(out / "drafter-ft", run, dir_b, init_from=dir_d, device=device, save_dtype=p.dtype,
                    eval_fn=measure, eval_every=every)
curve = [(0, before)] + [(e["step"], e["accept_length"]) for e in res.log.evals]
for s, a in curve:
    print(f"step {s:5d}: accept length {a:.3f}")

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(*zip(*curve), marker="o")
ax1.set_xlabel("fine-tuning step")
ax1.set_ylabel("accept length on target B")
ax1.set_title(f"drafter A fine-tuned on {samples} samples of mix B")
ax2.plot(res.log.history["loss"])
ax2.set_xlabel("fine-tuning step")
ax2.set_ylabel("TTT loss")
plt.show()

# %%
after = curve[-1][1]
kind = "exact" if device == "cpu" else "noisy"  # GPU training is not bit-reproducible: its results are noisy
record("accept_before", before, unit="tokens/cycle", kind=kind, direction="none", rel_tol=accept_tol,
       description=f"drafter A on target B before fine-tuning (greedy chain of {chain_steps}, mix B prompts)")
record("accept_after", after, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"after {run.steps} fine-tuning steps on {samples} samples of mix B")
record("accept_gain", after - before, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description="accept length gained by fine-tuning")
record("finetune_loss", res.final_loss, unit="nats", kind=kind, direction="lower", rel_tol=loss_tol,
       description="training-time-test loss at the end of fine-tuning")
