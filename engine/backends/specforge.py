"""SpecForge as the training backend: its feature-capture and training command lines, its run config, its checkpoint
layout, and the draft-vocabulary check a warm start needs.

Targets specforge 0.2.0 (PyPI; sgl-project/SpecForge with `version.txt` 0.2.0). That release replaced the old
`torchrun scripts/train_eagle3.py --target-model-path ... --tp-size ...` flags with one typed entry point,
`specforge train --config run.yaml` (a validated YAML run config), and `specforge export --to sglang`. Training here
is SpecForge's local offline EAGLE-3 mode, the one that fits an 8-GPU server whose GPUs the target fills:

1. capture: `torchrun scripts/prepare_hidden_states.py` (from a SpecForge checkout: scripts are not in the wheel)
   runs the target under SGLang at TP `tp` and writes one feature file per sample, the drafter's three feature
   layers and the last hidden state (`engine.backends.features` reads them);
2. train: `specforge train --config run.yaml`, data parallel over `nproc` GPUs (the target is not loaded: its
   features are on disk; SpecForge keeps trainer `tp_size` at 1 in offline mode);
3. export: `specforge export --to sglang` writes a drafter directory SGLang serves.

Online training (features streamed from a patched SGLang server through Mooncake, little disk) is SpecForge's other
mode; it is not wired here.

Warm start and the draft vocabulary: an EAGLE-3 head predicts draft ids, and `d2t` maps draft id i to target id
i + d2t[i]. A drafter fine-tuned from another one must keep that mapping: a mapping rebuilt from the new data moves
every head column to another token and ruins acceptance without showing in the training accuracy (the pitfall of
SpecForge PR 534). `TrainRun(init_drafter=..., vocab_mapping=...)` passes the initial drafter's mapping
(`model.vocab_mapping_path`; SpecForge derives none then) and `check_vocab_kept` checks the result.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open

from engine.errors import EngineError
from engine.fsutil import atomic_write
from engine.loading import weight_files

SPECFORGE_VERSION = "0.2.0"
STATE_FILE = "training_state.pt"  # SpecForge's checkpoint payload: {run_id}-step{N}/training_state.pt
VOCAB_KEYS = {"d2t": ("d2t", "draft_id_to_target_id"), "t2d": ("t2d",)}  # SGLang / vLLM names in a drafter


@dataclass
class CaptureRun:
    """scripts/prepare_hidden_states.py: the target's features for every sample of a conversation JSONL."""

    specforge_repo: str  # a SpecForge 0.2.0 checkout
    target: str
    draft_config: str  # a drafter's config.json: its eagle_aux_hidden_state_layer_ids decide the captured layers
    data_path: str  # conversation JSONL: {"id", "conversations": [{"role", "content"}, ...]}
    output_path: str
    chat_template: str = "kimi-k2-instruct"
    max_length: int = 2048
    tp: int = 8
    batch_size: int = 32
    num_samples: int | None = None
    mem_fraction: float | None = None
    # Runs the checkpoint's own Python (Kimi-K2's tokenizer and model code need it): opt in for a checkpoint you trust
    trust_remote_code: bool = False
    python: str = "python"

    def command(self) -> list[str]:
        script = Path(self.specforge_repo) / "scripts" / "prepare_hidden_states.py"
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(self.tp),
               str(script), "--strategy", "eagle3", "--target-model-path", self.target,
               "--draft-model-config", self.draft_config, "--data-path", self.data_path,
               "--output-path", self.output_path, "--chat-template", self.chat_template,
               "--max-length", str(self.max_length), "--tp-size", str(self.tp), "--batch-size", str(self.batch_size)]
        if self.num_samples is not None:
            cmd += ["--num-samples", str(self.num_samples)]
        if self.mem_fraction is not None:
            cmd += ["--sglang-mem-fraction-static", str(self.mem_fraction)]
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        return cmd


@dataclass
class TrainRun:
    """One `specforge train` run of EAGLE-3 on offline features; `config()` is its typed run config."""

    target: str  # the target's directory: tokenizer, embedding and lm_head come from it
    draft_config: str  # the drafter architecture: a config.json file (the export reads it too)
    features: str  # CaptureRun.output_path (or a subset of it, features.subset)
    output_dir: str
    run_id: str = "eagle3"
    init_drafter: str | None = None  # warm start: weights only (model.draft_checkpoint_path)
    vocab_mapping: str = ""  # a {"d2t", "t2d"} file (save_vocab_mapping); "" lets SpecForge derive one from the data
    num_epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 1
    learning_rate: float = 5e-5
    max_length: int = 2048
    ttt_length: int = 7
    nproc: int = 8  # trainer ranks, data parallel
    save_interval: int = 0  # 0: only the final checkpoint
    seed: int = 0
    cache_dir: str = "./cache"
    embedding_key: str = "model.embed_tokens.weight"  # the target's tensor names (a multimodal checkpoint prefixes
    lm_head_key: str = "lm_head.weight"  # them, e.g. language_model.): see its model.safetensors.index.json
    trust_remote_code: bool = False  # as CaptureRun's: opt in

    def __post_init__(self) -> None:
        if self.init_drafter and not self.vocab_mapping:
            raise EngineError("a warm start needs the initial drafter's vocab mapping (vocab_mapping=...): a mapping "
                              "derived from the new data would misalign its head")

    def config(self) -> dict[str, Any]:
        model: dict[str, Any] = {"target_model_path": self.target, "draft_model_config": self.draft_config,
                                 "target_backend": "sglang", "trust_remote_code": self.trust_remote_code,
                                 "embedding_key": self.embedding_key, "lm_head_key": self.lm_head_key,
                                 "torch_dtype": "bfloat16"}
        if self.init_drafter:
            model["draft_checkpoint_path"] = self.init_drafter
        if self.vocab_mapping:
            model["vocab_mapping_path"] = self.vocab_mapping
        training: dict[str, Any] = {"strategy": "eagle3", "num_epochs": self.num_epochs,
                                    "batch_size": self.batch_size, "learning_rate": self.learning_rate,
                                    "ttt_length": self.ttt_length, "tp_size": 1, "save_interval": self.save_interval,
                                    "seed": self.seed}
        if self.max_steps is not None:
            training["max_steps"] = self.max_steps
        return {"model": model,
                "data": {"hidden_states_path": self.features, "max_length": self.max_length,
                         "cache_dir": self.cache_dir},
                "training": training,
                "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": self.nproc}},
                "run_id": self.run_id, "output_dir": self.output_dir}

    def write_config(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, yaml.safe_dump(self.config(), sort_keys=False))
        return path

    def command(self, config_path: str | Path, python: str = "python") -> list[str]:
        # The CLI starts the nproc trainer ranks itself (deployment.trainer); no torchrun around it.
        return [python, "-m", "specforge.cli", "train", "--config", str(config_path)]


def export_command(checkpoint: str | Path, draft_config: str, output_dir: str | Path,
                   python: str = "python") -> list[str]:
    """`specforge export --to sglang` without --vocab-mapping: the export keeps the d2t the checkpoint holds, so a
    check of the exported drafter sees what training left."""
    return [python, "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(checkpoint),
            "--draft-config", draft_config, "--output-dir", str(output_dir)]


def run_logged(cmd: list[str], log_path: str | Path, env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> None:
    """Run one step of the pipeline to completion, its output in `log_path`; a failure names the log's tail."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=cwd).returncode
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise EngineError(f"{' '.join(cmd[:5])} ... exited with code {rc}; log {log_path}:\n{tail}")


# ------------------------------------------------------------------------------ draft vocabulary and checkpoints


def vocab_mapping(drafter_dir: str | Path) -> dict[str, torch.Tensor]:
    """d2t (int64) and t2d (bool) of a published EAGLE-3 drafter, read without loading its weights."""
    found: dict[str, torch.Tensor] = {}
    for f in weight_files(Path(drafter_dir)):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = key.removeprefix("model.")
                for want, aliases in VOCAB_KEYS.items():
                    if name in aliases:
                        found[want] = st.get_tensor(key)
    if "d2t" not in found:
        raise EngineError(f"{drafter_dir}: the drafter has no d2t (a full-vocabulary head needs no mapping to keep)")
    if "t2d" not in found:
        raise EngineError(f"{drafter_dir}: the drafter has d2t but no t2d")
    return {"d2t": found["d2t"].long(), "t2d": found["t2d"].bool()}


def save_vocab_mapping(drafter_dir: str | Path, path: str | Path) -> Path:
    """The drafter's mapping in the file format SpecForge's `model.vocab_mapping_path` loads ({"d2t", "t2d"})."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mapping = vocab_mapping(drafter_dir)
    atomic_write(path, lambda tmp: torch.save(mapping, tmp))
    return path


def latest_checkpoint(output_dir: str | Path, run_id: str) -> Path:
    """The checkpoint a finished run left: `{run_id}-latest` (a link SpecForge repoints on every save), else the
    highest `{run_id}-step{N}` holding a training_state.pt (filesystems without links)."""
    out = Path(output_dir)
    latest = out / f"{run_id}-latest"
    if (latest / STATE_FILE).is_file():
        return latest.resolve()
    steps = [(int(m.group(1)), p) for p in out.glob(f"{run_id}-step*")
             if (m := re.fullmatch(re.escape(run_id) + r"-step(\d+)", p.name)) and (p / STATE_FILE).is_file()]
    if not steps:
        raise EngineError(f"{out}: no checkpoint of run {run_id!r} ({run_id}-latest or {run_id}-step<N> with "
                          f"{STATE_FILE}); did training finish?")
    return max(steps)[1]


def trained_draft_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The draft weights of a SpecForge checkpoint directory (`draft_state_dict` of its training_state.pt)."""
    path = Path(checkpoint) / STATE_FILE
    try:
        # SpecForge's own payload (optimizer state, counters): not a weights-only file.
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (OSError, RuntimeError, EOFError) as e:
        raise EngineError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise EngineError(f"{path}: not a SpecForge checkpoint (no draft_state_dict)")
    if state.get("strategy", "eagle3") != "eagle3":
        raise EngineError(f"{path}: strategy {state['strategy']!r}, not eagle3")
    return state["draft_state_dict"]


def check_vocab_kept(initial: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], where: str) -> None:
    """Fail when a trained drafter's d2t (or t2d) differs from the initial drafter's: its head would be misaligned."""
    for key in ("d2t", "t2d"):
        got = next((v for k, v in trained.items() if k.removeprefix("model.") in VOCAB_KEYS[key]), None)
        if got is None:
            raise EngineError(f"{where}: no {key} to check against the initial drafter's")
        want = initial[key]
        if got.shape != want.shape:
            raise EngineError(f"{where}: {key} has shape {tuple(got.shape)}, the initial drafter's "
                              f"{tuple(want.shape)}: the draft vocabulary was rebuilt")
        moved = int((got.to(want.dtype) != want).sum())
        if moved:
            raise EngineError(f"{where}: {key} differs from the initial drafter's in {moved} of {want.numel()} "
                              f"entries: the draft vocabulary was rebuilt, the head is misaligned")


@dataclass
class TrainedDrafter:
    checkpoint: Path  # SpecForge's checkpoint directory
    drafter: Path  # the exported drafter SGLang serves


def train_and_export(run: TrainRun, work: str | Path, *, python: str = "python", env: dict[str, str] | None = None,
                     initial_vocab: dict[str, torch.Tensor] | None = None) -> TrainedDrafter:
    """Write the run config, train, export for SGLang; with `initial_vocab`, check the checkpoint and the exported
    drafter keep it. Logs and the config go to `work`."""
    work = Path(work)
    cfg = run.write_config(work / f"{run.run_id}.yaml")
    run_logged(run.command(cfg, python), work / f"{run.run_id}-train.log", env)
    ckpt = latest_checkpoint(run.output_dir, run.run_id)
    if initial_vocab is not None:
        check_vocab_kept(initial_vocab, trained_draft_state(ckpt), f"checkpoint {ckpt}")
    exported = work / f"{run.run_id}-sglang"
    run_logged(export_command(ckpt, run.draft_config, exported, python), work / f"{run.run_id}-export.log", env)
    if initial_vocab is not None:
        check_vocab_kept(initial_vocab, vocab_mapping(exported), f"exported drafter {exported}")
    return TrainedDrafter(ckpt, exported)
