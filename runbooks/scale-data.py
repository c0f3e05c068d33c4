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
# Profile `8x-rtx-pro-6000` (`backend=sglang`) runs it at real scale: Kimi-K2.5 under SGLang (TP `tp`) answers the
# prompts of `source_data` anew through its OpenAI-compatible API, SpecForge 0.2.0 captures its features on the
# answers and trains a fresh drafter on the first n of them for every n of `sample_counts`, and SGLang measures
# each drafter's accept length on K2.5 per prompt set. Its numbers are not verifiable here (no such hardware).
#
# ```yaml
# title: Approach B - accept length on target B against the number of training samples
# reproduces: [accept_at_min, accept_at_max]
# feeds: [game-plan.md]
# depends: [train-target]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu, sample_counts: [16, 128, 1024], steps: 100}
#   h200: {preset: gpu, device: cuda, sample_counts: [256, 1024, 4096], steps: 250}
#   cpu.dsv3: {preset: cpu, device: cpu, sample_counts: [16, 1024], steps: 60}
#   h200.dsv3: {preset: gpu, device: cuda, sample_counts: [256, 1024, 4096], steps: 250}
#   8x-rtx-pro-6000: {backend: sglang, target: /models/Kimi-K2.5-INT4, drafter: /models/Kimi-K2-Instruct-eagle3,
#                     source_data: /data/prompts.jsonl, specforge_repo: /opt/SpecForge,
#                     sample_counts: [50000, 100000, 200000], chain_steps: 3}
# timeout: 5400
# cell_timeout: 5000
# gpu_memory_gib: 28  # on its GPU profiles: train-drafter's preset on either family; records keep each run's peak
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
accept_tol = 0.0  # accept lengths: exact for the miniature; a real-scale profile sets one
# real scale (backend sglang; profile 8x-rtx-pro-6000); `steps` above caps every run's optimizer steps
backend = "bundled"  # bundled: the miniature pair in this process; sglang: the checkpoints above, SpecForge, SGLang
tp = 8  # SGLang tensor parallel: serving, regeneration and feature capture
nproc = 8  # SpecForge trainer ranks (data parallel)
nccl_env: dict = {}  # e.g. {"NCCL_P2P_LEVEL": "SYS"}: passed to every server, capture and training process
server_python: str | None = None  # interpreter with sglang + specforge 0.2.0 [default: this kernel's]
extra_server_args: list = []  # more SGLang flags, e.g. ["--mem-fraction-static", "0.85"]
prompt_sets: dict = {}  # name -> prompts file (.jsonl {"prompt"} or one a line); {}: the client's default mix
requests = 32  # per prompt set
max_tokens = 256
source_data: str | None = None  # conversations whose answers the target regenerates (SpecForge conversation JSONL)
regen_max_tokens = 2048
regen_temperature = 0.0
regen_concurrency = 64
draft_config: str | None = None  # the fresh drafters' architecture [default: the reference drafter's config.json]
specforge_repo: str | None = None  # a SpecForge 0.2.0 checkout (scripts/prepare_hidden_states.py)
chat_template = "kimi-k2-instruct"  # SpecForge's template name
max_length = 2048
num_epochs = 1
learning_rate = 1e-4
embedding_key = "model.embed_tokens.weight"  # the target's names for them (see its safetensors index)
lm_head_key = "lm_head.weight"
outputs_dir: str | None = None
upstream: dict = {}

# %% [markdown]
# ## At real scale (backend sglang)
#
# Regeneration appends to `regenerated.jsonl` in the run's outputs directory and skips what is there, so a stopped
# run resumes; the features of the largest count are captured once and every smaller count trains on the first n
# of them (nested subsets, no copies). Each drafter starts from scratch with the reference drafter's architecture.

# %%
if backend not in ("bundled", "sglang"):
    raise ValueError(f"backend must be bundled (the miniature pair) or sglang (real checkpoints), got {backend!r}")
at_scale = backend == "sglang"
# served runs vary, so their results are noisy; the miniature trains with deterministic kernels on every device
kind = "noisy" if at_scale else "exact"
if at_scale:
    import sys
    from pathlib import Path

    from engine.backends import LaunchConfig, serving
    from engine.backends.accept import chain_accept_by_prompt_set, mean_accept
    from engine.backends.features import subset
    from engine.backends.regenerate import regenerate
    from engine.backends.specforge import CaptureRun, TrainRun, run_logged, train_and_export
    from specbook import record

    arch = draft_config or (str(Path(drafter) / "config.json") if drafter else None)
    if not (target and source_data and specforge_repo and arch):
        raise ValueError("backend sglang needs target, source_data, specforge_repo and draft_config (or drafter)")
    work, py = Path(outputs_dir), server_python or sys.executable
    env = {k: str(v) for k, v in nccl_env.items()}
    server = dict(tp=tp, trust_remote_code=True, env=env, extra_args=tuple(extra_server_args), python=py,
                  startup_timeout_s=3600.0)
    ns = sorted(sample_counts)
    regen = work / "regenerated.jsonl"
    with serving("sglang", LaunchConfig(model=target, **server)) as url:
        got = regenerate(url, source_data, regen, limit=ns[-1], max_tokens=regen_max_tokens,
                         temperature=regen_temperature, concurrency=regen_concurrency)
    print(f"regenerated {got.written} conversations ({got.skipped} from an earlier run, {got.failed} failed)")
    if got.total < ns[-1]:
        raise RuntimeError(f"{got.total} regenerated conversations, fewer than the largest count {ns[-1]} "
                           f"(failures in {regen}.errors.jsonl; run again to retry them)")
    cap = CaptureRun(specforge_repo, target, arch, str(regen), str(work / "features"), chat_template=chat_template,
                     max_length=max_length, tp=tp, num_samples=ns[-1], python=py)
    print(" ".join(cap.command()))
    run_logged(cap.command(), work / "capture.log", env)

    def served_accept(draft: str, label: str) -> float:
        per_set = chain_accept_by_prompt_set("sglang", target, draft, chain_steps, prompt_sets, requests=requests,
                                             max_tokens=max_tokens, launch=server)
        for name, s in per_set.items():
            print(f"{label}, prompt set {name}: accept length {s.accept_length:.3f}")
            record(f"accept_{label}.{name}", s.accept_length, unit="tokens/cycle", kind=kind, direction="higher",
                   rel_tol=accept_tol, description=f"drafter {label} on the target, prompt set {name}")
        return mean_accept(per_set)

    scaled = {}
    for n in ns:
        run = TrainRun(target, arch, str(subset(work / "features", work / f"features-n{n}", n)),
                       str(work / "train"), run_id=f"n{n}", num_epochs=num_epochs, max_steps=steps,
                       learning_rate=learning_rate, max_length=max_length, nproc=nproc, embedding_key=embedding_key,
                       lm_head_key=lm_head_key)
        scaled[n] = served_accept(str(train_and_export(run, work, python=py, env=env).drafter), f"n{n}")
        record(f"accept_n{n}", scaled[n], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
               description=f"drafter trained on {n} regenerated samples, {num_epochs} epoch(s)"
                           f"{f' capped at {steps} steps' if steps else ''}, chain of {chain_steps}")
    if drafter is not None:
        record("accept_reference", served_accept(drafter, "reference"), unit="tokens/cycle",
               kind=kind, direction="none",
               rel_tol=accept_tol, description=f"the reference drafter {Path(drafter).name} on the same target")
    record("accept_at_min", scaled[ns[0]], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"accept length with the fewest samples ({ns[0]})")
    record("accept_at_max", scaled[ns[-1]], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"accept length with the most samples ({ns[-1]})")

# %%
if not at_scale:  # the miniature pair, in this process
    import tempfile
    from pathlib import Path

    import matplotlib.pyplot as plt
    import torch

    from engine.drafter import load_drafter
    from engine.loading import load_model
    from engine.train.drafter import accept_length, check_pair, held_out_prompts, train_drafter
    from engine.train.layout import TargetOutputs
    from engine.train.presets import get_preset, with_overrides
    from engine.train.tokenizer import load_tokenizer
    from specbook import record

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out = Path(outputs_dir or tempfile.mkdtemp(prefix="scale-data-"))
    p = get_preset(preset)
    run = with_overrides(p.drafter, steps=steps, mix="B")
    dir_b = Path(target or TargetOutputs(upstream["train-target"]).target_b)
    prompts = held_out_prompts(load_tokenizer(dir_b), eval_prompts or p.eval_prompts, p.prompt_chars, "B")
    model_b = load_model(dir_b, device=device, dtype=p.dtype)

# %%
if not at_scale:  # the miniature pair, in this process
    results = {}
    for n in sorted(sample_counts):
        res = train_drafter(out / f"drafter-n{n}", with_overrides(run, samples=n), dir_b, device=device,
                            save_dtype=p.dtype)
        draft = load_drafter(res.path, model_b)
        results[n] = (accept_length(model_b, draft, prompts, chain_steps, max_new_tokens or p.max_new_tokens), res)
        print(f"{n:8d} samples: accept length {results[n][0]:.3f}, final TTT loss {res.final_loss:.3f}")

# %%
if not at_scale:  # the miniature pair, in this process
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
if not at_scale:  # the miniature pair, in this process
    for n in ns:
        record(f"accept_n{n}", results[n][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
               description=f"drafter trained on {n} samples of mix B, {run.steps} steps, greedy chain of {chain_steps}")
    record("accept_at_min", results[ns[0]][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"accept length with the fewest samples ({ns[0]})")
    record("accept_at_max", results[ns[-1]][0], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"accept length with the most samples ({ns[-1]})")
