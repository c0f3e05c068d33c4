# %% [markdown]
# # Targets A and B: the miniature Kimi-K2 and Kimi-K2.5
#
# The game plan moves an EAGLE-3 drafter from Kimi-K2 to Kimi-K2.5, a model of the same architecture trained
# further on newer data. This runbook builds that situation in miniature from Python source: the pinned release
# archives of well-known pure-Python projects (`engine.train.corpus`, `engine/train/corpus.lock.toml`), the same
# bytes on every machine, in two groups: "classic" projects written before type hints and modern "typed" ones.
#
# - a byte-level BPE tokenizer shared by both targets (as K2 and K2.5 share theirs);
# - target **A** trained from scratch on mix A (half classic, half typed) - stands for K2;
# - target **B** = A trained further on mix B (mostly typed code) - stands for K2.5.
#
# Both are Hugging Face checkpoints (`target-a/`, `target-b/` in this runbook's outputs) that transformers and the
# engine load. Training resumes after a kill. `-p family=deepseek_v3` trains MLA + MoE targets through the same
# code; the `.dsv3` profiles (`runbook run train-target --profile cpu.dsv3`) do that and record apart, and every
# runbook downstream has the same profiles, so the approaches run on the game plan's own architecture too.
# `-p target=DIR` (and `-p target_b=DIR`) evaluate existing checkpoints instead of training them.
#
# ```yaml
# title: Targets A and B (miniature K2 and K2.5) - tokenizer, training, validation losses
# reproduces: [n_params, a_train_loss, a_val_loss, b_val_loss, a_val_loss_on_b, b_val_loss_on_a]
# feeds: [game-plan.md]
# depends: []
# inputs: [corpus]
# outputs:
#   paths: {target-a: "target A, the miniature Kimi-K2 (HF format: config.json, model.safetensors, tokenizer.json)",
#           target-b: "target B, the miniature Kimi-K2.5 (A trained further on mix B)",
#           tokenizer: "the byte-level BPE tokenizer both share"}
#   command: "{python} -m engine generate --target {outputs_dir}/target-a --prompt 'def fibonacci(n):' --max-new-tokens 64"
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda}
#   cpu.dsv3: {preset: cpu, device: cpu, family: deepseek_v3, steps_a: 100, steps_b: 40}
#   h200.dsv3: {preset: gpu, device: cuda, family: deepseek_v3}
# timeout: 3600
# cell_timeout: 3000
# gpu_memory_gib: 32  # on its GPU profiles: the dsv3 family's MoE target is the larger; records keep each run's peak (gpu_peak_gib)
# ```

# %% tags=["parameters"]
preset = "cpu"  # engine.train.presets: cpu (2 cores, minutes) or gpu (one H200, ~190M parameters)
family = "llama"  # llama | deepseek_v3
device = "cpu"
steps_a: int | None = None  # override the preset's optimizer steps
steps_b: int | None = None
target: str | None = None  # an existing HF checkpoint to use as target A instead of training one
target_b: str | None = None  # ... and as target B
threads = 2  # CPU threads: fixed, so that losses are reproducible to the last digits
loss_tol = 1e-4  # relative tolerance of the losses: exact for the miniature (seeds, pinned corpus, deterministic kernels)
outputs_dir: str | None = None
upstream: dict = {}

# %%
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from engine.loading import load_model
from engine.train import corpus
from engine.train.presets import get_preset, with_overrides
from engine.train.target import n_params as count_params, train_targets, validation_loss
from engine.train.tokenizer import load_tokenizer
from specbook import record

torch.set_num_threads(threads)
torch.manual_seed(0)
out = Path(outputs_dir or tempfile.mkdtemp(prefix="train-target-"))
p = get_preset(preset)
run_a, run_b = with_overrides(p.target_a, steps=steps_a), with_overrides(p.target_b, steps=steps_b)
print(f"corpus manifest {corpus.manifest_hash()}; outputs in {out}")
for key, row in corpus.stats().items():
    print(f"  {key:22s} {row['files']:6d} files {row['bytes'] / 1e6:8.1f} MB")

# %% [markdown]
# ## Training
#
# A from scratch, then B from A's weights with a fresh optimizer (continued pretraining). Progress bars show
# each run; an interrupted run picks up from its last checkpoint when the runbook is run again.

# %%
if target is None:
    res_a, res_b = train_targets(out, p, family, device, run_a, run_b)
    dir_a, dir_b = res_a.path, res_b.path
else:
    res_a = res_b = None
    dir_a, dir_b = Path(target), Path(target_b or target)
print("target A:", dir_a, "\ntarget B:", dir_b)

# %% [markdown]
# ## Loss curves

# %%
if res_a is not None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    la, lb = res_a.log.history["loss"], res_b.log.history["loss"]
    ax.plot(range(len(la)), la, label="A on mix A (train)")
    ax.plot(range(len(la), len(la) + len(lb)), lb, label="B on mix B (train, from A)")
    for res, name in ((res_a, "A"), (res_b, "B")):
        offset = 0 if name == "A" else len(la)
        ev = res.log.evals
        ax.plot([e["step"] + offset for e in ev], [e["val_loss"] for e in ev], "o", label=f"{name} validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    plt.show()

# %% [markdown]
# ## How far B moved from A
#
# Each target on each mix's validation split: B should be better than A on mix B (what it was trained on further)
# and a little worse on mix A - the distribution shift the drafter has to survive.

# %%
tok = load_tokenizer(dir_a)
model_a = load_model(dir_a, device=device)
model_b = load_model(dir_b, device=device)
losses = {(m, mix): validation_loss(model, tok, mix, run) for m, model in (("A", model_a), ("B", model_b))
          for mix, run in (("A", run_a), ("B", run_b))}
for (m, mix), v in losses.items():
    print(f"target {m} on mix {mix}: {v:.4f}")

# %% [markdown]
# ## Recorded numbers

# %%
kind = "exact"  # fixed seeds, pinned corpus, deterministic kernels (engine.train.loop.reproducible), GPU too
record("n_params", count_params(model_a), unit="parameters", direction="none",
       description="parameters of each target (A and B share the shape)")
record("a_train_loss", res_a.final_loss if res_a else losses["A", "A"], unit="nats", kind=kind, direction="lower",
       rel_tol=loss_tol, description="target A's training loss, mean of the last 5% of steps")
record("a_val_loss", losses["A", "A"], unit="nats", kind=kind, direction="lower", rel_tol=loss_tol,
       description="target A on mix A's validation split")
record("b_val_loss", losses["B", "B"], unit="nats", kind=kind, direction="lower", rel_tol=loss_tol,
       description="target B on mix B's validation split")
record("a_val_loss_on_b", losses["A", "B"], unit="nats", kind=kind, direction="none", rel_tol=loss_tol,
       description="target A on mix B: how unfamiliar the shifted data is to A")
record("b_val_loss_on_a", losses["B", "A"], unit="nats", kind=kind, direction="none", rel_tol=loss_tol,
       description="target B on mix A: what B forgot of A's data")
