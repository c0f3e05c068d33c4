"""The training loop every trainer shares: cosine schedule, gradient clipping, progress bar, and checkpoints that are
written atomically and resumed after a kill.

A run directory holds `train-state.pt` while training (model + optimizer + step + history, the parameters' hash)
and `train-log.json` once done. Batches are a pure function of (seed, step), so a resumed run ends in exactly the
state of an uninterrupted one. Resuming with other parameters is refused: the checkpoint would mean something else.

Every optimizer step runs with deterministic kernels (`reproducible`), on a GPU too: a run on the same hardware and
software gives its losses, and so its models and accept lengths, bit for bit, and a record verifies them exactly
instead of within a tolerance as wide as the run-to-run spread of atomic-add kernels.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from engine import fsutil, quiet
from engine.errors import EngineError

STATE = "train-state.pt"
LOG = "train-log.json"

# cuBLAS reproduces its results only with a fixed workspace; read when the process makes its first cuBLAS handle
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def reproducible() -> Iterator[None]:
    """Deterministic algorithms inside, strictly: an op without a deterministic kernel raises instead of warning.
    Strict mode is what makes attention reproducible: SDPA then leaves out cuDNN's attention (no deterministic
    backward) and runs flash / memory-efficient attention with their deterministic backward, which they use only when
    warnings are not allowed. The previous setting is restored after. The price is speed: a deterministic backward
    parallelises less."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@dataclass
class Schedule:
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    ckpt_every: int = 50

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(self.steps - self.warmup, 1)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class TrainLog:
    params: dict[str, Any]
    history: dict[str, list[float]] = field(default_factory=dict)  # per step: loss, lr, and what step_fn adds
    evals: list[dict[str, float]] = field(default_factory=list)  # {"step": s, ...} from eval_fn

    @property
    def final_loss(self) -> float:
        tail = self.history["loss"][-max(1, len(self.history["loss"]) // 20):]  # mean of the last 5%
        return sum(tail) / len(tail)


def params_hash(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _why(e: OSError) -> str:
    return "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """engine.fsutil.atomic_write (a reader sees the old file or the new one, never half of one); disk full (or any
    OSError) leaves the previous file intact and becomes one clear error."""
    try:
        fsutil.atomic_write(path, write)
    except OSError as e:
        kept = "; the previous one is intact" if path.exists() else ""
        raise EngineError(f"{_why(e)} while writing {path}{kept}") from None


@contextlib.contextmanager
def disk_errors(where: Path) -> Iterator[None]:
    """Final checkpoint writes (each file replaced atomically by its writer): an OSError becomes one clear error;
    the resume state stays, so the run can be finished again once there is room."""
    try:
        yield
    except OSError as e:
        raise EngineError(f"{_why(e)} while saving the finished model to {where}; rerun to retry") from None


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The changed parameters, named by their dotted paths (run.lr: 0.01 -> 0.005)."""
    old, new = _flat(json.loads(json.dumps(old, default=str))), _flat(json.loads(json.dumps(new, default=str)))
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:4]) + (" ..." if len(keys) > 4 else "")


def read_log(run_dir: Path, params: dict[str, Any]) -> TrainLog | None:
    """The finished run's log if run_dir holds one made with these parameters; an error if with others."""
    f = run_dir / LOG
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    if d["params_hash"] != params_hash(params):
        raise EngineError(f"{run_dir} holds a finished run with other parameters ({_diff(d['params'], params)}); "
                          "use another output directory or delete it")
    return TrainLog(d["params"], d["history"], d["evals"])


def _load_state(run_dir: Path, params: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer
                ) -> tuple[int, TrainLog]:
    f = run_dir / STATE
    if not f.is_file():
        return 0, TrainLog(params)
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which and stop
        raise EngineError(f"{f}: unreadable checkpoint ({type(e).__name__}); delete it to start over") from None
    if state["params_hash"] != params_hash(params):
        raise EngineError(f"{f} was written with other parameters ({_diff(state['params'], params)}); "
                          "resume with the same ones, or use another output directory")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return state["step"], TrainLog(params, state["history"], state["evals"])


def save_state(run_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, log: TrainLog) -> None:
    state = {"params_hash": params_hash(log.params), "params": log.params, "step": step,
             "model": model.state_dict(), "opt": opt.state_dict(), "history": log.history, "evals": log.evals}
    atomic_write(run_dir / STATE, lambda tmp: torch.save(state, tmp))


def finish(run_dir: Path, log: TrainLog) -> None:
    """Write the log of a finished run and drop the (large) resume state."""
    d = {"params_hash": params_hash(log.params), "params": log.params, "history": log.history, "evals": log.evals}
    atomic_write(run_dir / LOG, lambda tmp: tmp.write_text(json.dumps(d) + "\n"))
    (run_dir / STATE).unlink(missing_ok=True)


StepFn = Callable[[int], tuple[torch.Tensor, dict[str, float]]]  # step -> (loss to minimise, extra numbers)


def train(run_dir: Path, params: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, sched: Schedule,
          step_fn: StepFn, desc: str, eval_fn: Callable[[], dict[str, float]] | None = None,
          eval_every: int = 0, after_step: Callable[[int], None] | None = None) -> TrainLog:
    """Run (or resume) sched.steps optimizer steps. The caller saves the model and calls finish().
    after_step(steps done) runs after each step's evaluation and before its checkpoint (e.g. to save a snapshot)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start, log = _load_state(run_dir, params, model, opt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    bar = tqdm(range(start, sched.steps), desc=desc, initial=start, total=sched.steps, mininterval=2.0)
    for step in bar:
        quiet.yield_point()  # a runner's timing lock: a timing runbook beside this one may want the device now
        lr = sched.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        with reproducible():
            loss, extra = step_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(trainable, sched.grad_clip)
            opt.step()
        row = {"loss": loss.item(), "lr": lr, "grad_norm": gnorm.item(), **extra}
        for k, v in row.items():
            log.history.setdefault(k, []).append(v)
        bar.set_postfix(loss=f"{row['loss']:.3f}", refresh=False)
        done = step + 1
        if eval_fn is not None and eval_every and (done % eval_every == 0 or done == sched.steps):
            log.evals.append({"step": done, **eval_fn()})
        if after_step is not None:
            after_step(done)
        if done % sched.ckpt_every == 0 and done < sched.steps:
            save_state(run_dir, done, model, opt, log)
    bar.close()
    return log
