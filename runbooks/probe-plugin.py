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
# Profile `8x-rtx-pro-6000` (`backend=sglang`) runs it at real scale: Kimi-K2 and Kimi-K2.5 under SGLang (TP `tp`),
# each with the K2 drafter unchanged; accept length per prompt set through the benchmark client, and the hidden
# states at the drafter's feature layers from SpecForge's offline dump of both targets on the same samples; then it
# prints where the reading falls on the miniature's curves of `drift-dial` (when recorded). Its numbers are not
# verifiable here (no such hardware).
#
# ```yaml
# title: Approach C - hidden-state similarity of A and B per layer; drafter A's accept length on B vs on A
# reproduces: [cos_aux_mean, cos_min, accept_on_a, accept_on_b, accept_kept]
# feeds: [game-plan.md]
# depends: [train-target, train-drafter]
# inputs: [corpus]
# profiles:
#   cpu: {preset: cpu, device: cpu}
#   h200: {preset: gpu, device: cuda}
#   cpu.dsv3: {preset: cpu, device: cpu}
#   h200.dsv3: {preset: gpu, device: cuda}
#   8x-rtx-pro-6000: {backend: sglang, target: /models/Kimi-K2-Instruct, target_b: /models/Kimi-K2.5-INT4,
#                     drafter: /models/Kimi-K2-Instruct-eagle3, capture_data: /data/k25-eval.jsonl,
#                     specforge_repo: /opt/SpecForge, chain_steps: 3}
# timeout: 1800
# cell_timeout: 1500
# gpu_memory_gib: 12  # on its GPU profiles: two miniature targets and a drafter, inference
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
cos_tol = 1e-4  # relative tolerance of the cosines: exact for the miniature; a real-scale profile sets its own
accept_tol = 0.0  # accept lengths: exact for the miniature; a real-scale profile sets one
# real scale (backend sglang; profile 8x-rtx-pro-6000)
backend = "bundled"  # bundled: the miniature pair in this process; sglang: the checkpoints above under SGLang
tp = 8  # SGLang tensor parallel, serving and feature capture
nccl_env: dict = {}  # e.g. {"NCCL_P2P_LEVEL": "SYS"}: passed to every server and capture process
server_python: str | None = None  # interpreter with sglang + specforge 0.2.0 [default: this kernel's]
extra_server_args: list = []  # more SGLang flags, e.g. ["--mem-fraction-static", "0.85"]
prompt_sets: dict = {}  # name -> prompts file (.jsonl {"prompt"} or one a line); {}: the client's default mix
requests = 32  # per prompt set
max_tokens = 256
capture_data: str | None = None  # SpecForge conversation JSONL whose samples both targets' features are taken on
capture_samples = 256
specforge_repo: str | None = None  # a SpecForge 0.2.0 checkout (scripts/prepare_hidden_states.py)
chat_template = "kimi-k2-instruct"  # SpecForge's template name for the capture
outputs_dir: str | None = None
upstream: dict = {}

# %% [markdown]
# ## At real scale (backend sglang)
#
# Hidden states: SpecForge captures both targets' features on the same `capture_samples` samples of
# `capture_data`, at the layers the drafter's config names (its three feature layers, then the last layer's output);
# the cosine similarity is averaged over every token, as below. Accept length: each target served by SGLang with the
# drafter unchanged, a greedy chain of `chain_steps`, per prompt set; the recorded number is the mean over sets.

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
    from engine.backends.features import similarity
    from engine.backends.specforge import CaptureRun, run_logged
    from specbook import record

    if not all((target, target_b, drafter, capture_data, specforge_repo)):
        raise ValueError("backend sglang needs target, target_b, drafter, capture_data and specforge_repo")
    work, py = Path(outputs_dir), server_python or sys.executable
    env = {k: str(v) for k, v in nccl_env.items()}
    models = {"a": target, "b": target_b}
    for name, model in models.items():
        cap = CaptureRun(specforge_repo, model, str(Path(drafter) / "config.json"), capture_data,
                         str(work / f"features-{name}"), chat_template=chat_template, tp=tp,
                         num_samples=capture_samples, python=py)
        print(" ".join(cap.command()))
        run_logged(cap.command(), work / f"capture-{name}.log", env)
    sim = similarity(work / "features-a", work / "features-b")
    print(f"cosine A vs B over {sim.tokens} tokens: feature layers {[round(c, 4) for c in sim.aux]}, "
          f"last layer {sim.last:.4f}")
    server = dict(tp=tp, trust_remote_code=True, env=env, extra_args=tuple(extra_server_args), python=py,
                  startup_timeout_s=3600.0)
    tau = {}
    for name, model in models.items():
        per_set = chain_accept_by_prompt_set("sglang", model, drafter, chain_steps, prompt_sets, requests=requests,
                                             max_tokens=max_tokens, launch=server)
        for set_name, s in per_set.items():
            print(f"drafter A on target {name.upper()}, prompt set {set_name}: accept length {s.accept_length:.3f}")
            record(f"accept_on_{name}.{set_name}", s.accept_length, unit="tokens/cycle", kind=kind, direction="higher",
                   rel_tol=accept_tol, description=f"drafter A on target {name.upper()}, prompt set {set_name}")
        tau[name] = mean_accept(per_set)
    record("cos_aux_mean", sim.aux_mean, unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
           description=f"A-vs-B cosine similarity at the drafter's three feature layers, mean ({sim.samples} "
                       f"samples of {Path(capture_data).name})")
    record("cos_min", sim.min, unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
           description="lowest A-vs-B cosine similarity over the captured layers (feature layers and the last)")
    record("accept_on_a", tau["a"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"drafter A on target A under SGLang, chain of {chain_steps}, mean over prompt sets")
    record("accept_on_b", tau["b"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description="drafter A plugged into target B unchanged, same settings and prompts")
    record("accept_kept", kept_share(tau["b"], tau["a"]), unit="fraction", kind=kind, direction="higher",
           rel_tol=accept_tol, description="share of drafter A's accepted draft tokens per cycle that survive on B")

    # where the reading falls on drift-dial's recorded fits (baselines/drift-dial.yaml, when there is one): the kept
    # share its line predicts at this similarity and which thresholds the reading passes, the MLA + MoE family's
    # curves first (K2's and K2.5's family), with the caveat of scale
    from engine.train.drift import on_the_dial
    from specbook.records import load as load_record, path_for

    dial = load_record(path_for(Path.cwd(), "drift-dial")).data["profiles"]  # none recorded: no profiles
    for prof in sorted(dial, key=lambda name: (not name.endswith(".dsv3"), not name.startswith("h200"), name)):
        values = {name: m["value"] for name, m in dial[prof].get("metrics", {}).items()}
        if "kept_fit.slope" not in values:
            continue
        share = dial[prof]["runs"][-1]["parameters"].get("recover_share", 0.9)
        print(f"on drift-dial's curve of profile {prof}:")
        for line in on_the_dial(sim.aux_mean, values, share, kept_share(tau["b"], tau["a"])):
            print(f"  {line}")
    if not dial:
        print("no drift-dial record yet: `runbook run drift-dial --record` on a miniature profile draws the curve")

# %%
if not at_scale:  # the miniature pair, in this process
    from pathlib import Path

    import matplotlib.pyplot as plt
    import torch

    from engine.drafter import load_drafter
    from engine.loading import load_model
    from engine.metrics import kept_share
    from engine.train.drafter import accept_length, check_pair, held_out_prompts
    from engine.train.drift import layer_cosines, probe_similarity
    from engine.train.layout import DrafterOutputs, TargetOutputs
    from engine.train.presets import get_preset
    from engine.train.tokenizer import load_tokenizer
    from specbook import record

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    p = get_preset(preset)
    dir_a = Path(target or TargetOutputs(upstream["train-target"]).target_a)
    dir_b = Path(target_b or TargetOutputs(upstream["train-target"]).target_b)
    dir_d = Path(drafter or DrafterOutputs(upstream["train-drafter"]).drafter_a)
    for d in (dir_a, dir_b):
        check_pair(d, dir_d)
    model_a = load_model(dir_a, device=device, dtype=p.dtype)
    model_b = load_model(dir_b, device=device, dtype=p.dtype)
    prompts = held_out_prompts(load_tokenizer(dir_a), eval_prompts or p.eval_prompts, p.prompt_chars, mix)

# %% [markdown]
# ## Hidden states, layer by layer
#
# Layer i below is the residual stream entering layer i (0 = the embeddings, L = the last layer's output), on
# every token of every prompt; the similarity is averaged over tokens.

# %%
if not at_scale:  # the miniature pair, in this process
    cos = layer_cosines(model_a, model_b, prompts)
    layers = tuple(range(len(cos)))
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
if not at_scale:  # the miniature pair, in this process
    new_tokens = max_new_tokens or p.max_new_tokens
    tau = {}
    for name, model in (("A", model_a), ("B", model_b)):
        tau[name] = accept_length(model, load_drafter(dir_d, model), prompts, chain_steps, new_tokens)
        print(f"drafter A on target {name}: accept length {tau[name]:.3f}")

# %%
if not at_scale:  # the miniature pair, in this process
    record("cos_aux_mean", probe_similarity(cos, aux_layers), unit="cosine",
           kind=kind, direction="none", rel_tol=cos_tol,
           description="A-vs-B cosine similarity at the drafter's three feature layers, mean")
    record("cos_min", min(cos), unit="cosine", kind=kind, direction="none", rel_tol=cos_tol,
           description="lowest A-vs-B cosine similarity over layers")
    record("accept_on_a", tau["A"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"drafter A on target A, greedy chain of {chain_steps}, held-out prompts of mix {mix}")
    record("accept_on_b", tau["B"], unit="tokens/cycle", kind=kind, direction="higher", rel_tol=accept_tol,
           description=f"drafter A plugged into target B unchanged, same prompts")
    record("accept_kept", kept_share(tau["B"], tau["A"]), unit="fraction", kind=kind, direction="higher",
           rel_tol=accept_tol, description="share of drafter A's accepted draft tokens per cycle that survive on B")
