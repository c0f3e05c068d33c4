# %% [markdown]
# # Approach B: accept length against the amount of training data
#
# The game plan's third option: train a drafter for K2.5 on more data (the K2 drafter's 3.2-3.5 accept length came
# from 1.4M samples). In miniature: fresh drafters for target B, each trained with the same number of optimizer
# steps on a different number of samples (prompts from mix B answered by target B, as EAGLE regenerates its data);
# accept length on B's held-out prompts as a curve. With little data the drafter memorises its samples; the curve
# shows how fast more data pays.
#
# `-p target=DIR` runs the sweep for a real target; `-p drafter=DIR` draws an existing drafter's accept length on
# it as a reference line (e.g. the old K2 drafter plugged into K2.5).
#
# ```yaml
# title: Approach B - accept length on target B against the number of training samples
# reproduces: [accept_at_min, accept_at_max]
# feeds: [game-plan.md]
# depends: [train-target]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu, sample_counts: [16, 128, 1024], steps: 100}
#   h200: {preset: gpu, device: cuda, sample_counts: [256, 1024, 4096], steps: 400, accept_tol: 0.05}
#   cpu.dsv3: {preset: cpu, device: cpu, sample_counts: [16, 1024], steps: 60}
#   h200.dsv3: {preset: gpu, device: cuda, sample_counts: [256, 1024, 4096], steps: 600, accept_tol: 0.05}
# timeout: 5400
# cell_timeout: 5000
# ```

# %% tags=["parameters"]
preset = "cpu"
device = "cpu"
sample_counts = [16, 128, 1024]  # training samples (regenerated sequences) per drafter
steps: int | None = None  # optimizer steps of every drafter (the same for all: only the data changes)
chain_steps = 7
eval_prompts: int | None = None
max_new_tokens: int | None = None
target: str | None = None  # [default: train-target's target-b]
drafter: str | None = None  # a reference drafter measured on the same target and prompts
threads = 2
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
out = Path(outputs_dir or tempfile.mkdtemp(prefix="scale-data-"))
p = get_preset(preset)
run = with_overrides(p.drafter, steps=steps, mix="B")
dir_b = Path(target or Path(upstream["train-target"]) / "target-b")
prompts = prompt_ids(load_tokenizer(dir_b), eval_prompts or p.eval_prompts, p.prompt_chars, "B")
model_b = load_model(dir_b, device=device, dtype=p.dtype)

# %%
results = {}
for n in sorted(sample_counts):
    res = train_drafter(out / f"drafter-n{n}", with_overrides(run, samples=n), dir_b, device=device,
                        save_dtype=p.dtype)
    draft = load_drafter(res.path, model_b)
    results[n] = (accept_length(model_b, draft, prompts, chain_steps, max_new_tokens or p.max_new_tokens), res)
    print(f"{n:8d} samples: accept length {results[n][0]:.3f}, final TTT loss {res.final_loss:.3f}")

# %%
reference = None
if drafter is not None:
    check_pair(dir_b, Path(drafter))
    reference = accept_length(model_b, load_drafter(drafter, model_b), prompts, chain_steps,
                              max_new_tokens or p.max_new_tokens)
    print(f"reference drafter {drafter}: accept length {reference:.3f}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ns = sorted(results)
ax1.plot(ns, [results[n][0] for n in ns], marker="o")
if reference is not None:
    ax1.axhline(reference, color="tab:gray", linestyle="--", label="reference drafter")
    ax1.legend()
ax1.set_xscale("log")
ax1.set_xlabel(f"training samples of {run.seq_len} tokens")
ax1.set_ylabel("accept length on target B")
for n in ns:
    ax2.plot(results[n][1].log.history["loss"], label=f"{n} samples")
ax2.set_xlabel("optimizer step")
ax2.set_ylabel("TTT loss (training samples)")
ax2.legend()
plt.show()

# %%
kind = "exact" if device == "cpu" else "noisy"  # GPU training is not bit-reproducible: its results are noisy
for n in ns:
    record(f"accept_n{n}", results[n][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"drafter trained on {n} samples of mix B, {run.steps} steps, greedy chain of {chain_steps}")
record("accept_at_min", results[ns[0]][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"accept length with the fewest samples ({ns[0]})")
record("accept_at_max", results[ns[-1]][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"accept length with the most samples ({ns[-1]})")
