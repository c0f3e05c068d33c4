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
# Profile `8x-rtx-pro-6000` (`backend=sglang`) runs it at real scale with SpecForge 0.2.0: Kimi-K2.5's features on
# the K2.5 samples (`train_data`) are captured under SGLang (TP `tp`), the AQ-MedAI K2 drafter is fine-tuned on them
# (weights-only warm start, its draft vocabulary mapping passed to SpecForge and checked unchanged afterwards), and
# its accept length on K2.5 is measured under SGLang before and after, per prompt set. Its numbers are not
# verifiable here (no such hardware).
#
# ```yaml
# title: Approach A - drafter A fine-tuned on a small sample of mix B; accept length on target B against steps
# reproduces: [accept_before, accept_after, accept_gain]
# feeds: [game-plan.md]
# depends: [train-target, train-drafter]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda, samples: 1024}
#   cpu.dsv3: {preset: cpu, device: cpu}
#   h200.dsv3: {preset: gpu, device: cuda, samples: 1024}
#   8x-rtx-pro-6000: {backend: sglang, target: /models/Kimi-K2.5-INT4, drafter: /models/Kimi-K2-Instruct-eagle3,
#                     train_data: /data/k25-samples.jsonl, specforge_repo: /opt/SpecForge, samples: 37000,
#                     chain_steps: 3}
# timeout: 3600
# cell_timeout: 3000
# gpu_memory_gib: 28  # on its GPU profiles: train-drafter's preset on either family, fine-tuning; records keep each run's peak
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
loss_tol = 1e-4  # relative tolerance of the losses: exact for the miniature (seeds, pinned corpus, deterministic kernels)
accept_tol = 0.0  # accept lengths: exact for the miniature; a real-scale profile sets one
# real scale (backend sglang; profile 8x-rtx-pro-6000); `samples` and `steps` above cap the data and the steps
backend = "bundled"  # bundled: the miniature pair in this process; sglang: the checkpoints above, SpecForge, SGLang
tp = 8  # SGLang tensor parallel, serving and feature capture
nproc = 8  # SpecForge trainer ranks (data parallel)
nccl_env: dict = {}  # e.g. {"NCCL_P2P_LEVEL": "SYS"}: passed to every server, capture and training process
server_python: str | None = None  # interpreter with sglang + specforge 0.2.0 [default: this kernel's]
extra_server_args: list = []  # more SGLang flags, e.g. ["--mem-fraction-static", "0.85"]
prompt_sets: dict = {}  # name -> prompts file (.jsonl {"prompt"} or one a line); {}: the client's default mix
requests = 32  # per prompt set
max_tokens = 256
train_data: str | None = None  # the K2.5 samples, SpecForge conversation JSONL
features: str | None = None  # an earlier capture of train_data [default: captured here]
specforge_repo: str | None = None  # a SpecForge 0.2.0 checkout (scripts/prepare_hidden_states.py)
chat_template = "kimi-k2-instruct"  # SpecForge's template name
max_length = 2048
num_epochs = 1
learning_rate = 5e-5
embedding_key = "model.embed_tokens.weight"  # the target's names for them (see its safetensors index)
lm_head_key = "lm_head.weight"
outputs_dir: str | None = None
upstream: dict = {}

# %% [markdown]
# ## At real scale (backend sglang)
#
# Capture, fine-tune and export with SpecForge (`engine.backends.specforge`), accept length under SGLang (greedy
# chain of `chain_steps`, the mean over prompt sets is recorded). The run config, the logs and the exported drafter
# stay in the run's outputs directory.

# %%
if backend not in ("bundled", "sglang"):
    raise ValueError(f"backend must be bundled (the miniature pair) or sglang (real checkpoints), got {backend!r}")
at_scale = backend == "sglang"
# served runs vary, so their results are noisy; the miniature trains with deterministic kernels on every device
kind = "noisy" if at_scale else "exact"
if at_scale:
    import sys
    from pathlib import Path

    from engine.backends.accept import chain_accept_by_prompt_set, mean_accept
    from engine.backends.specforge import CaptureRun, TrainRun, run_logged, save_vocab_mapping, train_and_export
    from engine.backends.specforge import vocab_mapping
    from specbook import record

    if not (target and drafter and (train_data or features) and specforge_repo):
        raise ValueError("backend sglang needs target, drafter, train_data (or features) and specforge_repo")
    work, py = Path(outputs_dir), server_python or sys.executable
    env = {k: str(v) for k, v in nccl_env.items()}
    draft_cfg = str(Path(drafter) / "config.json")
    if features is None:
        features = str(work / "features")
        cap = CaptureRun(specforge_repo, target, draft_cfg, train_data, features, chat_template=chat_template,
                         max_length=max_length, tp=tp, num_samples=samples, python=py)
        print(" ".join(cap.command()))
        run_logged(cap.command(), work / "capture.log", env)

    server = dict(tp=tp, trust_remote_code=True, env=env, extra_args=tuple(extra_server_args), python=py,
                  startup_timeout_s=3600.0)

    def served_accept(draft: str, label: str) -> float:
        per_set = chain_accept_by_prompt_set("sglang", target, draft, chain_steps, prompt_sets, requests=requests,
                                             max_tokens=max_tokens, launch=server)
        for name, s in per_set.items():
            print(f"{label}, prompt set {name}: accept length {s.accept_length:.3f}")
            record(f"accept_{label}.{name}", s.accept_length, unit="tokens/cycle", kind=kind, direction="higher",
                   rel_tol=accept_tol, description=f"drafter {label} fine-tuning on target B, prompt set {name}")
        return mean_accept(per_set)

    before = served_accept(drafter, "before")
    run = TrainRun(target, draft_cfg, features, str(work / "train"), run_id="finetune", init_drafter=drafter,
                   vocab_mapping=str(save_vocab_mapping(drafter, work / "vocab_mapping.pt")),
                   num_epochs=num_epochs, max_steps=steps, learning_rate=learning_rate, max_length=max_length,
                   nproc=nproc, embedding_key=embedding_key, lm_head_key=lm_head_key)
    trained = train_and_export(run, work, python=py, env=env, initial_vocab=vocab_mapping(drafter))
    print(f"fine-tuned: {trained.checkpoint}; d2t/t2d unchanged; exported for SGLang to {trained.drafter}")
    after = served_accept(str(trained.drafter), "after")
    record("accept_before", before, unit="tokens/cycle", kind=kind, direction="none", rel_tol=accept_tol,
           description=f"drafter A on target B under SGLang before fine-tuning (chain of {chain_steps}, mean "
                       f"over prompt sets)")
    record("accept_after", after, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"after fine-tuning on {samples} samples of {Path(train_data or features).name}")
    record("accept_gain", after - before, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description="accept length gained by fine-tuning")

# %%
if not at_scale:  # the miniature pair, in this process
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
    out = Path(outputs_dir or tempfile.mkdtemp(prefix="finetune-drafter-"))
    p = get_preset(preset)
    run = with_overrides(p.finetune, steps=steps, samples=samples)
    every = eval_every or max(run.steps // 4, 1)
    dir_b = Path(target or TargetOutputs(upstream["train-target"]).target_b)
    dir_d = Path(drafter or DrafterOutputs(upstream["train-drafter"]).drafter_a)
    check_pair(dir_b, dir_d)
    prompts = held_out_prompts(load_tokenizer(dir_b), eval_prompts or p.eval_prompts, p.prompt_chars, "B")
    new_tokens = max_new_tokens or p.max_new_tokens

    def measure(draft, model) -> dict[str, float]:
        return {"accept_length": accept_length(model, draft, prompts, chain_steps, new_tokens)}

# %% [markdown]
# ## Before: drafter A plugged into B unchanged

# %%
if not at_scale:  # the miniature pair, in this process
    model_b = load_model(dir_b, device=device, dtype=p.dtype)
    before = measure(load_drafter(dir_d, model_b), model_b)["accept_length"]
    print(f"accept length on B before fine-tuning: {before:.3f}")
    del model_b

# %% [markdown]
# ## Fine-tuning on the small sample

# %%
if not at_scale:  # the miniature pair, in this process
    res = train_drafter(out / "drafter-ft", run, dir_b, init_from=dir_d, device=device, save_dtype=p.dtype,
                        eval_fn=measure, eval_every=every)
    curve = [(0, before)] + [(e["step"], e["accept_length"]) for e in res.log.evals]
    for s, a in curve:
        print(f"step {s:5d}: accept length {a:.3f}")

# %%
if not at_scale:  # the miniature pair, in this process
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
if not at_scale:  # the miniature pair, in this process
    after = curve[-1][1]
    record("accept_before", before, unit="tokens/cycle", kind=kind, direction="none", rel_tol=accept_tol,
           description=f"drafter A on target B before fine-tuning (greedy chain of {chain_steps}, mix B prompts)")
    record("accept_after", after, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"after {run.steps} fine-tuning steps on {samples} samples of mix B")
    record("accept_gain", after - before, unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description="accept length gained by fine-tuning")
    record("finetune_loss", res.final_loss, unit="nats", kind=kind, direction="lower", rel_tol=loss_tol,
           description="training-time-test loss at the end of fine-tuning")
