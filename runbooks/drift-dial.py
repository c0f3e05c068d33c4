# %% [markdown]
# # Drift dial: what the probe's reading predicts
#
# Approach C of the game plan gives one reading: how similar the new target's hidden states are to the old one's.
# The decision between A (fine-tune the old drafter on the samples at hand) and B (generate many more samples)
# needs two numbers that reading does not give: how much accept length the old drafter keeps, and how many samples
# a fine-tune needs to win the rest back. This runbook measures both against the probe's reading on a dial of
# targets in miniature:
#
# 1. **The dial.** Target A trained further from its own weights on a shifted mix (`dials`: mix -> step counts), one
#    run per mix with a snapshot at each count (`engine.train.target.train_target(snapshots=)`), so that a run of n
#    steps gives every target of the dial up to n for the cost of one; a second mix (AB, between A's and B's) changes
#    the kind of drift, and train-target's own target B (probe-plugin's pair) is one more point.
# 2. **Each target B_i's distance from A**: the probe's similarity (the cosine of the residual streams at the
#    drafter's three feature layers, `engine.train.drift.layer_cosines`, the function probe-plugin uses), the KL of
#    the next-token distributions and the relative distance of the weights.
# 3. **What it costs the drafter**: drafter A's accept length on B_i and its kept share (of its accepted draft tokens
#    per cycle on A); drafter A fine-tuned on n samples of B_i's mix answered by B_i, for each n of `sample_counts`,
#    beside a drafter trained from scratch on the same samples with the same steps.
# 4. **The curves and the rule**: straight lines with their standard errors through (a) the kept share against the
#    probe's similarity and (b) the samples a fine-tune needs to recover `recover_share` of A's accepted draft
#    tokens; the similarities at which each line reaches that share are the decision rule's thresholds.
#
# Every accept length and distance is taken on the same held-out prompts (of mix `eval_mix`, as probe-plugin's), so
# train-target's own B lands where probe-plugin records it. probe-plugin's real-scale profile reads the recorded
# fits back and places the real K2 -> K2.5 reading on these curves.
#
# ```yaml
# title: Drift dial - the old drafter's kept share and the samples a fine-tune needs, against the probe's similarity
# reproduces: [accept_on_a, kept_fit.slope, kept_fit.intercept]
# feeds: [game-plan.md]
# depends: [train-target, train-drafter]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   cpu.dsv3: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda, dials: {B: [10, 30], AB: [30]}, sample_counts: [128, 1024], ft_steps: 30,
#          ft_batch_size: null, eval_prompts: 8}
#   h200.dsv3: {preset: gpu, device: cuda, dials: {B: [10, 30], AB: [30]}, sample_counts: [128, 1024], ft_steps: 30,
#               ft_batch_size: null, eval_prompts: 8}
# timeout: 3600
# cell_timeout: 3000
# gpu_memory_gib: 32  # on its GPU profiles: targets trained further, drafters fine-tuned, the dsv3 family the larger; records keep each run's peak
# ```

# %% tags=["parameters"]
preset = "cpu"
device = "cpu"
dials: dict = {"B": [4, 12], "AB": [12]}  # mix -> step counts: A trained further on the mix, a target at each
with_pair = True  # train-target's own target B (probe-plugin's pair) as one more point of the dial
sample_counts = [16, 128]  # samples of each fine-tune (and of each drafter from scratch beside it)
ft_steps: int | None = 10  # optimizer steps of every fine-tune and drafter from scratch [default: the preset's]
ft_batch_size: int | None = 4  # their batch [default: the preset's]
recover_share = 0.9  # the goal: this share of drafter A's accepted draft tokens per cycle on A
band_se = 1.0  # the plotted bands and the thresholds' ranges: this many standard errors of the fit
chain_steps = 7
eval_prompts: int | None = None  # held-out prompts [default: the preset's]
max_new_tokens: int | None = None
eval_mix = "A"  # the held-out prompts' mix (A: the drafter's own kind of data, as probe-plugin's)
target: str | None = None  # target A [default: train-target's target-a]
drafter: str | None = None  # drafter A [default: train-drafter's drafter-a]
threads = 2
loss_tol = 1e-4  # relative tolerance of the losses: exact for the miniature (seeds, corpus, deterministic kernels)
cos_tol = 1e-4  # the cosines and the other distances
accept_tol = 0.0  # accept lengths: exact for the miniature
fit_tol = 1e-3  # the fits' numbers (a difference of similarities amplifies the cosines' last digits)
outputs_dir: str | None = None
upstream: dict = {}

# %%
import dataclasses
import math
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.ticker import NullFormatter

from engine.drafter import load_drafter
from engine.loading import load_model
from engine.metrics import kept_share
from engine.train.drafter import accept_length, check_pair, held_out_prompts, train_drafter, training_sequences
from engine.train.drift import (layer_cosines, linear_fit, log_distance, next_token_kl, probe_similarity,
                                samples_to_recover, similarity_at, weight_distance)
from engine.train.layout import TargetOutputs, trained_pair_dirs
from engine.train.presets import get_preset, with_overrides
from engine.train.target import train_target
from engine.train.tokenizer import load_tokenizer
from specbook import record

torch.set_num_threads(threads)
torch.manual_seed(0)
kind = "exact"  # fixed seeds, pinned corpus, deterministic kernels (engine.train.loop.reproducible), GPU too
out = Path(outputs_dir or tempfile.mkdtemp(prefix="drift-dial-"))
p = get_preset(preset)
dir_a, dir_d = trained_pair_dirs(target, drafter, upstream)
check_pair(dir_a, dir_d)
prompts = held_out_prompts(load_tokenizer(dir_a), eval_prompts or p.eval_prompts, p.prompt_chars, eval_mix)
new_tokens = max_new_tokens or p.max_new_tokens
counts = sorted(sample_counts)
model_a = load_model(dir_a, device=device, dtype=p.dtype)
aux_layers = load_drafter(dir_d, model_a).aux_layers
accept_a = accept_length(model_a, load_drafter(dir_d, model_a), prompts, chain_steps, new_tokens)
goal = 1 + recover_share * (accept_a - 1)  # the accept length that keeps recover_share of A's draft tokens
print(f"drafter A on target A: accept length {accept_a:.3f}; the goal, {recover_share:.0%} of its accepted draft "
      f"tokens: {goal:.3f}")

# %% [markdown]
# ## The dial: one continued-training run per mix
#
# Each run starts from A's weights with the preset's run for target B (learning rate, warm-up, batch, seed), its
# length the mix's largest step count; the snapshots are the targets B_i (a step count's target saw the schedule of
# the whole run, not one of its own length).

# %%
points = []  # (label, mix, steps, checkpoint directory)
for mix, steps in dials.items():
    run = with_overrides(p.target_b, mix=mix, steps=max(steps))
    res = train_target(out / f"dial-{mix}", run, dir_a, init_from=dir_a, device=device, save_dtype=p.dtype,
                       snapshots=steps)
    points += [(f"{mix}{s}", mix, s, res.snapshots[s]) for s in sorted(steps)]
if with_pair and "train-target" in upstream:
    points.append(("pair", "B", None, TargetOutputs(upstream["train-target"]).target_b))
print("targets of the dial:", ", ".join(label for label, *_ in points))

# %% [markdown]
# ## Each target: its distance from A, and what the old drafter keeps on it

# %%
rows = {}
for label, mix, steps, dir_b in points:
    model_b = load_model(dir_b, device=device, dtype=p.dtype)
    cos = layer_cosines(model_a, model_b, prompts)
    accept_old = accept_length(model_b, load_drafter(dir_d, model_b), prompts, chain_steps, new_tokens)
    rows[label] = dict(mix=mix, steps=steps, dir=dir_b, sim=probe_similarity(cos, aux_layers), cos_min=min(cos),
                       kl=next_token_kl(model_a, model_b, prompts), weight=weight_distance(model_a, model_b),
                       accept_old=accept_old, kept_old=kept_share(accept_old, accept_a))
    del model_b
    r = rows[label]
    print(f"{label:6s} probe similarity {r['sim']:.4f}  KL {r['kl']:.4f} nats/token  weights {r['weight']:.4f}  "
          f"drafter A: accept {r['accept_old']:.3f}, kept {r['kept_old']:.2f}")

# %% [markdown]
# ## Fine-tunes against drafters from scratch, per target and sample count
#
# The samples: prompts of B_i's own mix answered by B_i (the data the new target would give), regenerated once for
# the largest count; each count trains on the first n of them (nested samples). The fine-tune starts from drafter A
# (its draft vocabulary kept), the drafter from scratch from nothing, with the same samples, steps and warm-up.

# %%
steps_ft = ft_steps or p.finetune.steps
warmup = max(1, steps_ft // 10)
for label, r in rows.items():
    model_b = load_model(r["dir"], device=device, dtype=p.dtype)
    r["ft"], r["scratch"] = {}, {}
    largest = with_overrides(p.finetune, mix=r["mix"], samples=counts[-1], steps=steps_ft, warmup=warmup,
                             batch_size=ft_batch_size)
    seqs = training_sequences(r["dir"], largest, device)  # regenerated once: each count takes the first n
    for n in counts:
        ft = with_overrides(largest, samples=n)
        scratch = with_overrides(p.drafter, mix=ft.mix, samples=n, steps=steps_ft, warmup=warmup, seed=ft.seed,
                                 batch_size=ft.batch_size, data_bytes=ft.data_bytes, seq_len=ft.seq_len,
                                 regen_tokens=ft.regen_tokens)
        for key, run, init in (("ft", ft, dir_d), ("scratch", scratch, None)):
            res = train_drafter(out / f"{key}-{label}-n{n}", run, r["dir"], init_from=init, device=device,
                                save_dtype=p.dtype, seqs=seqs[:n])
            acc = accept_length(model_b, load_drafter(res.path, model_b), prompts, chain_steps, new_tokens)
            r[key][n] = (acc, res.final_loss)
    r["recover"] = samples_to_recover(counts, [r["ft"][n][0] for n in counts], goal, before=r["accept_old"])
    del model_b
    need = f"more than {counts[-1]}" if r["recover"] is None else f"{r['recover']:.0f}"
    print(f"{label:6s} " + "  ".join(f"n={n}: fine-tune {r['ft'][n][0]:.3f}, scratch {r['scratch'][n][0]:.3f}"
                                     for n in counts) + f"  -> samples to recover: {need}")

# %% [markdown]
# ## The curves
#
# The fits take the probe's reading as a distance, log10(1 - similarity) (`engine.train.drift.log_distance`): a
# line in it stays below similarity 1 wherever it reaches the goal, and the dial's first steps move the similarity
# least and the drafter most. (a) the old drafter's kept share against it, (b) the fine-tunes' kept share per sample
# count, each a straight line by least squares with a band of `band_se` standard errors; a line's threshold W is the
# similarity at which it reaches `recover_share` (its range: where the band does). (c) samples to recover: measured
# per target (interpolated in log samples; a triangle down: the old drafter keeps enough; up: no count did), with
# the thresholds of (a) and (b) as the rule's steps. Beyond the dial's range the lines are extrapolated.

# %%
labels = list(rows)
dist = [log_distance(rows[k]["sim"]) for k in labels]


def fit_or_none(xs, ys):
    try:
        return linear_fit(xs, ys)
    except Exception as e:  # too few points or one distance: say so, record no fit
        print(f"no fit: {e}")
        return None


kept_fit = fit_or_none(dist, [rows[k]["kept_old"] for k in labels])
ft_fits = {n: fit_or_none(dist, [kept_share(rows[k]["ft"][n][0], accept_a) for k in labels]) for n in counts}


def threshold(fit):
    """W, the similarity at which the line reaches recover_share, and its band's range (similarities), when the
    line falls with distance."""
    if fit is None or fit.slope >= 0:
        return None, None
    band = fit.solve_band(recover_share, band_se)
    return similarity_at(fit.solve(recover_share)), band and tuple(sorted(similarity_at(x) for x in band))


w_keep, w_keep_band = threshold(kept_fit)
w_ft = {n: threshold(f) for n, f in ft_fits.items()}
recovered = [(d, rows[k]["recover"]) for d, k in zip(dist, labels) if rows[k]["recover"]]
recover_fit = fit_or_none([d for d, _ in recovered], [math.log10(n) for _, n in recovered]) \
    if len(recovered) >= 3 else None

# %%
colors = {mix: c for mix, c in zip(dict.fromkeys(rows[k]["mix"] for k in labels), plt.cm.tab10.colors)}
lo = min(dist + [log_distance(w) for w, _ in [(w_keep, 0), *w_ft.values()] if w is not None]) - 0.2
hi = max(dist) + 0.2
grid = [lo + (hi - lo) * i / 50 for i in range(51)]
x_label = "probe distance: 1 - cosine at the drafter's feature layers (log scale)"


def draw_fit(ax, fit, color, label, ymap=lambda y: y):
    ys = [fit(x) for x in grid]
    band = [band_se * fit.se(x) for x in grid]
    xs = [10 ** x for x in grid]
    ax.plot(xs, [ymap(y) for y in ys], color=color, label=label)
    ax.fill_between(xs, [ymap(y - b) for y, b in zip(ys, band)], [ymap(y + b) for y, b in zip(ys, band)],
                    color=color, alpha=0.15)


def draw_points(ax, ys, marker="o"):
    for k, y in zip(labels, ys):
        ax.scatter(1 - rows[k]["sim"], y, color=colors[rows[k]["mix"]], marker=marker, zorder=3)
        ax.annotate(k, (1 - rows[k]["sim"], y), textcoords="offset points", xytext=(4, 4), fontsize=8)


fig, axes = plt.subplots(1, 2, figsize=(12, 4))
ax = axes[0]
draw_points(ax, [rows[k]["kept_old"] for k in labels])
if kept_fit:
    draw_fit(ax, kept_fit, "tab:gray", f"fit, band {band_se:g} standard error(s)")
ax.axhline(recover_share, color="tab:red", linestyle=":", label=f"goal: {recover_share:.0%} kept")
if w_keep:
    ax.axvline(1 - w_keep, color="tab:red", alpha=0.4, label=f"W = {w_keep:.4f}")
ax.set_xscale("log")
ax.xaxis.set_minor_formatter(NullFormatter())
ax.set_xlabel(x_label)
ax.set_ylabel("kept share of drafter A (fraction of its draft tokens on A)")
ax.set_title("(a) drafter A plugged in unchanged")
ax.legend(fontsize=8)
ax = axes[1]
for n, c in zip(counts, plt.cm.viridis([0.2, 0.5, 0.8, 0.95])):
    ax.scatter([1 - rows[k]["sim"] for k in labels], [kept_share(rows[k]["ft"][n][0], accept_a) for k in labels],
               color=c, zorder=3)
    if ft_fits[n]:
        draw_fit(ax, ft_fits[n], c, f"fine-tuned on {n} samples")
ax.axhline(recover_share, color="tab:red", linestyle=":")
ax.set_xscale("log")
ax.xaxis.set_minor_formatter(NullFormatter())
ax.set_xlabel(x_label)
ax.set_ylabel("kept share after fine-tuning (fraction)")
ax.set_title(f"(b) drafter A fine-tuned, {steps_ft} steps")
ax.legend(fontsize=8)
plt.show()

# %%
fig, ax = plt.subplots(figsize=(7, 4))
top, bottom = counts[-1] * 3, counts[0] / 3
for k in labels:
    n = rows[k]["recover"]
    y, marker = (top, "^") if n is None else (bottom, "v") if n == 0 else (n, "o")
    ax.scatter(1 - rows[k]["sim"], y, marker=marker, color=colors[rows[k]["mix"]], zorder=3)
    ax.annotate(k, (1 - rows[k]["sim"], y), textcoords="offset points", xytext=(4, 4), fontsize=8)
for (w, band), y, what in [((w_keep, w_keep_band), bottom, "no fine-tune"),
                           *((w_ft[n], n, f"{n} samples") for n in counts)]:
    if w is not None:
        err = None if band is None else [[(1 - w) - (1 - band[1])], [(1 - band[0]) - (1 - w)]]
        ax.errorbar([1 - w], [y], xerr=err, fmt="s", color="tab:red", capsize=3)
        ax.annotate(f"W: {what}", (1 - w, y), textcoords="offset points", xytext=(4, -12), fontsize=8,
                    color="tab:red")
if recover_fit:
    draw_fit(ax, recover_fit, "tab:gray", "fit of log10(samples)", ymap=lambda y: 10 ** y)
    ax.legend(fontsize=8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.xaxis.set_minor_formatter(NullFormatter())
ax.set_xlabel(x_label)
ax.set_ylabel(f"samples to recover {recover_share:.0%} (sequences)")
ax.set_title(f"(c) bottom: none needed; top: more than {counts[-1]}")
plt.show()

# %% [markdown]
# ## The plain distances, and fine-tune against scratch

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, key, what in ((axes[0], "weight", "weight distance from A (relative)"),
                      (axes[1], "kl", "KL(A || B_i) of next tokens (nats/token)")):
    draw_points(ax, [rows[k][key] for k in labels])
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(x_label)
    ax.set_ylabel(what)
plt.show()

fig, ax = plt.subplots(figsize=(7, 4))
for k in labels:
    c = colors[rows[k]["mix"]]
    ax.plot(counts, [rows[k]["ft"][n][0] for n in counts], marker="o", color=c, alpha=0.8)
    ax.plot(counts, [rows[k]["scratch"][n][0] for n in counts], marker="x", linestyle="--", color=c, alpha=0.8)
    ax.annotate(k, (counts[-1], rows[k]["ft"][counts[-1]][0]), textcoords="offset points", xytext=(4, 0), fontsize=8)
ax.axhline(goal, color="tab:red", linestyle=":", label=f"goal: {recover_share:.0%} of A's draft tokens")
ax.set_xscale("log")
ax.set_xlabel("training samples (sequences)")
ax.set_ylabel("accept length on B_i (tokens/cycle)")
ax.set_title(f"fine-tuned (solid) and from scratch (dashed), {steps_ft} steps")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Recorded numbers

# %%
record("accept_on_a", accept_a, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
       description=f"drafter A on target A, greedy chain of {chain_steps}, held-out prompts of mix {eval_mix}")
for k in labels:
    r = rows[k]
    what = "train-target's target B" if k == "pair" else f"A trained {r['steps']} steps further on mix {r['mix']}"
    record(f"sim.{k}", r["sim"], unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
           description=f"{what}: probe similarity (mean cosine with A at the drafter's feature layers)")
    record(f"cos_min.{k}", r["cos_min"], unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
           description=f"{what}: lowest cosine with A over layers")
    record(f"kl.{k}", r["kl"], unit="nats/token", kind=kind, direction="none", rel_tol=cos_tol,
           description=f"{what}: KL(A || B_i) of the next-token distributions on the held-out prompts")
    record(f"weight_dist.{k}", r["weight"], unit="fraction", kind=kind, direction="none", rel_tol=cos_tol,
           description=f"{what}: ||weights - A's|| / ||A's||")
    record(f"accept_old.{k}", r["accept_old"], unit="tokens/cycle", kind=kind, direction="none", rel_tol=accept_tol,
           description=f"{what}: drafter A plugged in unchanged")
    record(f"kept_old.{k}", r["kept_old"], unit="fraction", kind=kind, direction="none", rel_tol=accept_tol,
           description=f"{what}: drafter A's kept share of its accepted draft tokens on A")
    for n in counts:
        for key, who in (("ft", "drafter A fine-tuned"), ("scratch", "a drafter from scratch")):
            acc, loss = r[key][n]
            record(f"accept_{key}_n{n}.{k}", acc, unit="tokens/cycle", kind=kind, direction="none",
                   rel_tol=accept_tol, description=f"{what}: {who} on {n} samples, {steps_ft} steps")
            record(f"loss_{key}_n{n}.{k}", loss, unit="nats", kind=kind, direction="none", rel_tol=loss_tol,
                   description=f"{what}: training-time-test loss of {who} on {n} samples at the end")
    if r["recover"] is not None:
        record(f"samples_to_recover.{k}", r["recover"], unit="samples", kind=kind, direction="none",
               rel_tol=fit_tol, description=f"{what}: samples a fine-tune needs to keep {recover_share:.0%} "
                                            f"(interpolated in log samples; 0: none needed)")


def record_fit(name, fit, what):
    for field, v in dataclasses.asdict(fit).items():
        record(f"{name}.{field}", v, unit="points" if field == "n" else "-", kind=kind, direction="none",
               rel_tol=fit_tol, description=f"{what}: straight-line fit's {field}")


def record_threshold(name, w, band, what):
    if w is None:
        print(f"{name}: the line does not fall with distance; no threshold")
        return
    record(name, w, unit="cosine", kind=kind, direction="none", rel_tol=fit_tol, description=what)
    if band is not None:
        for end, v in zip(("lo", "hi"), band):
            record(f"{name}_{end}", v, unit="cosine", kind=kind, direction="none", rel_tol=fit_tol,
                   description=f"{what}: {end} end of its {band_se:g}-standard-error range")


if kept_fit:
    record_fit("kept_fit", kept_fit, "drafter A's kept share against log10(1 - probe similarity)")
for n, fit in ft_fits.items():
    if fit:
        record_fit(f"ft_fit_n{n}", fit, f"kept share after fine-tuning on {n} samples against log10(1 - probe "
                                        f"similarity)")
if recover_fit:
    record_fit("recover_fit", recover_fit, "log10(samples to recover) against log10(1 - probe similarity)")
record_threshold("w_keep", w_keep, w_keep_band,
                 f"probe similarity above which drafter A keeps {recover_share:.0%} unchanged (fit a)")
for n, (w, band) in w_ft.items():
    record_threshold(f"w_recover_n{n}", w, band, f"probe similarity above which a fine-tune on {n} samples "
                                                 f"({steps_ft} steps) keeps {recover_share:.0%} (fit b)")
