# %% [markdown]
# # Drafter A: an EAGLE-3 drafter trained on target A
#
# Stands for the AQ-MedAI Kimi-K2 drafter of the game plan. EAGLE-3 training as the paper and SpecForge do it
# (`engine.train.drafter`): hidden states of three target layers generated online from the frozen target,
# training-time test unrolled over 7 draft steps with loss weights 0.8**j, soft cross-entropy against the target's
# distribution over a draft vocabulary of the most frequent tokens (d2t/t2d), AdamW(0.9, 0.95), gradient clip 0.5.
# The result is in the published format that SGLang and vLLM load (`drafter-a/` in this runbook's outputs).
#
# Accept length is measured with the engine's own speculative decoder on held-out prompts (windows of test-split
# files): greedy, chain of 7 draft steps, all decode tokens over all verify cycles, the bonus token included.
# `-p target=DIR -p drafter=DIR` measure a real pair instead of training one.
#
# ```yaml
# title: Drafter A (EAGLE-3 on target A) - training-time test, accept length on held-out prompts
# reproduces: [accept_length]
# feeds: [game-plan.md]
# depends: [train-target]
# inputs: [corpus]
# outputs:
#   paths: {drafter-a: "drafter A, EAGLE-3 trained on target A (the published format SGLang and vLLM load)"}
#   command: "{python} -m engine generate --target {train-target}/target-a --drafter {outputs_dir}/drafter-a
#     --prompt 'def fibonacci(n):' --max-new-tokens 64"
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda}
#   cpu.dsv3: {preset: cpu, device: cpu, steps: 100}
#   h200.dsv3: {preset: gpu, device: cuda}
# timeout: 3600
# cell_timeout: 3000
# gpu_memory_gib: 28  # on its GPU profiles: the dsv3 target's hidden states beside the drafter's training; records keep each run's peak
# ```

# %% tags=["parameters"]
preset = "cpu"
device = "cpu"
steps: int | None = None  # override the preset's optimizer steps
chain_steps = 7  # draft steps per cycle when measuring accept length
eval_prompts: int | None = None  # held-out prompts [default: the preset's]
max_new_tokens: int | None = None
target: str | None = None  # target A checkpoint [default: train-target's target-a]
drafter: str | None = None  # an existing drafter to measure instead of training one
threads = 2
loss_tol = 1e-4  # relative tolerance of the losses: exact for the miniature (seeds, pinned corpus, deterministic kernels)
accept_tol = 0.0  # accept lengths: exact for the miniature; a real-scale profile sets one
outputs_dir: str | None = None
upstream: dict = {}

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from engine.drafter import load_drafter
from engine.loading import load_model
from engine.train.drafter import accept_length, check_pair, held_out_prompts, train_drafter
from engine.train.layout import DrafterOutputs, TargetOutputs
from engine.train.presets import get_preset, with_overrides
from engine.train.tokenizer import load_tokenizer
from specbook import record

torch.set_num_threads(threads)
torch.manual_seed(0)
out = Path(outputs_dir or tempfile.mkdtemp(prefix="train-drafter-"))
p = get_preset(preset)
run = with_overrides(p.drafter, steps=steps)
target_dir = Path(target or TargetOutputs(upstream["train-target"]).target_a)

# %% [markdown]
# ## Training

# %%
if drafter is None:
    res = train_drafter(DrafterOutputs(out).drafter_a, run, target_dir, device=device, save_dtype=p.dtype)
    drafter_dir = res.path
else:
    res, drafter_dir = None, Path(drafter)
    check_pair(target_dir, drafter_dir)
print("drafter:", drafter_dir)

# %%
if res is not None:
    h = res.log.history
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(h["loss"])
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("TTT loss (sum over steps, weighted)")
    ax2.bar(range(len(res.step_acc)), res.step_acc)
    ax2.set_xlabel("unrolled draft step j")
    ax2.set_ylabel("top-1 agreement with the target")
    plt.show()

# %% [markdown]
# ## Accept length on held-out prompts

# %%
tok = load_tokenizer(target_dir)
model = load_model(target_dir, device=device, dtype=p.dtype)
draft = load_drafter(drafter_dir, model)
prompts = held_out_prompts(tok, eval_prompts or p.eval_prompts, p.prompt_chars, "A")
tau = accept_length(model, draft, prompts, chain_steps, max_new_tokens or p.max_new_tokens)
print(f"accept length {tau:.3f} (chain of {chain_steps}, greedy, {len(prompts)} prompts)")

# %%
kind = "exact"  # fixed seeds, pinned corpus, deterministic kernels (engine.train.loop.reproducible), GPU too
if res is not None:
    record("drafter_loss", res.final_loss, unit="nats", kind=kind, direction="lower", rel_tol=loss_tol,
           description="training-time-test loss at the end of training (weighted sum over the unrolled steps)")
    record("step0_acc", res.step_acc[0], unit="fraction", kind=kind, direction="higher", rel_tol=loss_tol,
           description="top-1 agreement of the first draft step with the target, end of training")
record("accept_length", tau, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"greedy chain of {chain_steps} on target A, held-out prompts, bonus token included")
