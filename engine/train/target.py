"""Targets A and B: A trained from scratch on mix A (stands for Kimi-K2), B = A trained further on the shifted mix B
(Kimi-K2.5). Any ModelConfig family trains through the same engine.model.Transformer with autograd; the result is
an HF checkpoint (config.json, model.safetensors, tokenizer.json) that transformers and the engine both load."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.loading import load_model, random_model, read_config, resolve_dtype, save_model
from engine.model import Transformer
from engine.train import corpus, loop
from engine.train.data import batch_at, eval_batches, token_stream
from engine.train.layout import TargetOutputs
from engine.train.presets import Preset, TargetRun, target_config
from engine.train.tokenizer import eos_id, load_tokenizer, save_tokenizer, tokenizer_hash, train_tokenizer


@dataclass
class TargetResult:
    path: Path
    n_params: int
    final_loss: float  # mean training loss over the last 5% of steps
    val_loss: float
    log: loop.TrainLog
    snapshots: dict[int, Path] = field(default_factory=dict)  # step -> the model as it was after that step


def snapshot_dir(out_dir: str | Path, step: int) -> Path:
    """Where train_target(..., snapshots=) saves the model as it was after `step` steps: a checkpoint of its own."""
    return Path(out_dir) / f"step-{step}"


def autocast(device: torch.device):
    """bf16 autocast on CUDA (weights and optimizer stay fp32); plain fp32 on CPU, where bf16 is slow."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    x, y = batch[:, :-1], batch[:, 1:]
    logits, _ = model(x, torch.arange(x.shape[1], device=x.device))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def mean_loss(model, batches: list[torch.Tensor], device: torch.device) -> float:
    with autocast(device):
        return sum(lm_loss(model, b.to(device)).item() for b in batches) / len(batches)


def validation_batches(tok, mix: str, run: TargetRun) -> list[torch.Tensor]:
    """The fixed batches of a mix's validation split that training evaluates on."""
    ids = token_stream(tok, corpus.texts(mix, "validation", max(run.data_bytes // 10, 200_000)))
    return eval_batches(ids, run.eval_batches, run.batch_size, run.seq_len)


def validation_loss(model: Transformer, tok, mix: str, run: TargetRun) -> float:
    """Mean next-token loss of a model on a mix's validation split (compare A and B on both mixes)."""
    return mean_loss(model, validation_batches(tok, mix, run), model.device)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW(0.9, 0.95); no decay on norms and biases (1-d parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused or None)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()  # read in blocks (hashlib.file_digest needs Python 3.11)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def check_vocab(cfg: ModelConfig, tokenizer_dir: Path, vocab: int) -> None:
    if cfg.vocab_size != vocab:
        raise EngineError(f"the model's vocab_size is {cfg.vocab_size} but the tokenizer in {tokenizer_dir} has "
                          f"{vocab} tokens: they must match")


def train_target(out_dir: str | Path, run: TargetRun, tokenizer_dir: str | Path, cfg: ModelConfig | None = None,
                 init_from: str | Path | None = None, device: str = "cpu", save_dtype: str = "float32",
                 snapshots: Sequence[int] = ()) -> TargetResult:
    """Train a target into out_dir (resuming an interrupted run there). Either cfg (from scratch) or init_from
    (an existing checkpoint trained further, as B from A). A finished run with the same inputs is not redone.
    snapshots: step counts after which the model is also saved as it is then (snapshot_dir), so that one run gives
    the targets of several lengths of training (each on the same schedule, that of run.steps)."""
    out, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    if (cfg is None) == (init_from is None):
        raise EngineError("train a target either from a config or from an existing checkpoint (init_from), not both")
    snapshots = sorted(set(snapshots))
    if snapshots and not 0 < snapshots[0] <= snapshots[-1] <= run.steps:
        raise EngineError(f"snapshot steps must lie in 1..{run.steps} (the run's steps), got {snapshots}")
    tok = load_tokenizer(tokenizer_dir)
    cfg = read_config(init_from) if init_from is not None else cfg
    check_vocab(cfg, tokenizer_dir, tok.get_vocab_size())
    if init_from is not None and tokenizer_hash(init_from) not in (None, tokenizer_hash(tokenizer_dir)):
        raise EngineError(f"{init_from} was trained with another tokenizer than {tokenizer_dir}")
    params = {"run": dataclasses.asdict(run), "config": cfg.to_hf(), "tokenizer": tokenizer_hash(tokenizer_dir),
              "corpus": corpus.manifest_hash(), "save_dtype": save_dtype,
              "init_from": file_digest(Path(init_from) / "model.safetensors") if init_from else None}
    if snapshots:  # only then: the parameters (and so the finished runs) of a run without snapshots stay as they were
        params["snapshots"] = snapshots
    if (log := loop.read_log(out, params)) is not None and (out / "model.safetensors").is_file():
        if missing := [s for s in snapshots if not (snapshot_dir(out, s) / "model.safetensors").is_file()]:
            raise EngineError(f"{out} holds a finished run whose snapshot(s) at step(s) {missing} are gone; "
                              "delete it to train again")
        return _result(out, read_config(out), log, snapshots)

    dev = torch.device(device)
    train_ids = token_stream(tok, corpus.texts(run.mix, "train", run.data_bytes))
    model = load_model(init_from, device=dev) if init_from else random_model(cfg, device=dev, seed=run.seed)
    model.train()
    opt = make_optimizer(model, run.lr, run.weight_decay)
    fwd = torch.compile(model) if run.compile and dev.type == "cuda" else model
    val = validation_batches(tok, run.mix, run)

    def step_fn(step: int):
        with autocast(dev):
            return lm_loss(fwd, batch_at(train_ids, step, run.batch_size, run.seq_len, run.seed).to(dev)), {}

    def eval_fn() -> dict[str, float]:
        model.eval()
        loss = mean_loss(fwd, val, dev)
        model.train()
        return {"val_loss": loss}

    def save(where: Path) -> None:
        with loop.disk_errors(where):
            save_model(model.eval(), where, dtype=resolve_dtype(save_dtype))
            save_tokenizer(tok, where)

    def after_step(done: int) -> None:
        if done in snapshots:
            save(snapshot_dir(out, done))
            model.train()

    sched = loop.Schedule(run.steps, run.lr, run.warmup, run.min_lr_ratio, run.grad_clip, run.ckpt_every)
    desc = f"target {out.name} ({run.mix})"
    log = loop.train(out, params, model, opt, sched, step_fn, desc, eval_fn, run.eval_every or run.steps,
                     after_step if snapshots else None)
    save(out)
    loop.finish(out, log)
    return _result(out, model.cfg, log, snapshots)


def _result(out: Path, cfg: ModelConfig, log: loop.TrainLog, snapshots: Sequence[int] = ()) -> TargetResult:
    with torch.device("meta"):
        count = n_params(Transformer(cfg))
    return TargetResult(out, count, log.final_loss, log.evals[-1]["val_loss"], log,
                        {s: snapshot_dir(out, s) for s in snapshots})


def ensure_tokenizer(out_dir: str | Path, vocab_size: int, text_bytes: int) -> Path:
    """The shared tokenizer of both targets, trained on both mixes' train splits (reused when already there)."""
    out = Path(out_dir)
    params = {"vocab_size": vocab_size, "text_bytes": text_bytes, "corpus": corpus.manifest_hash()}
    stamp = out / "tokenizer-params.json"
    if (out / "tokenizer.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == params:
        return out
    texts = corpus.texts("A", "train", text_bytes // 2) + corpus.texts("B", "train", text_bytes // 2)
    save_tokenizer(train_tokenizer(texts, vocab_size), out)
    loop.atomic_write(stamp, lambda tmp: tmp.write_text(json.dumps(params) + "\n"))
    return out


def train_targets(out_dir: str | Path, preset: Preset, family: str = "llama", device: str | None = None,
                  a: TargetRun | None = None, b: TargetRun | None = None) -> tuple[TargetResult, TargetResult]:
    """The tokenizer, target A (from scratch on mix A) and target B (A trained further on mix B) under out_dir, as
    engine.train.layout.TargetOutputs names them."""
    out = TargetOutputs(out_dir)
    device = device or preset.device
    tok_dir = ensure_tokenizer(out.tokenizer, preset.vocab_size, preset.tokenizer_bytes)
    eos = eos_id(load_tokenizer(tok_dir))
    cfg = target_config(preset, family, eos_id=eos)
    ra = train_target(out.target_a, a or preset.target_a, tok_dir, cfg, device=device, save_dtype=preset.dtype)
    rb = train_target(out.target_b, b or preset.target_b, tok_dir, init_from=ra.path, device=device,
                      save_dtype=preset.dtype)
    return ra, rb
