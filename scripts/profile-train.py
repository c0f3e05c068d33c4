#!/usr/bin/env python3
"""Where a training step's time goes: ms per optimizer step of a preset's target and drafter on random tokens, with
deterministic kernels (engine.train.loop.reproducible, what every recorded training uses) and without, then
torch.profiler's ops by self time for a few deterministic steps. A diagnostic to run on a lent GPU before changing
the training code: it writes nothing and records nothing.

    python scripts/profile-train.py --preset gpu                  # both, the preset's shapes, on CUDA
    python scripts/profile-train.py --preset cpu --what drafter --steps 3 --json

Exit codes: 0 done, 2 bad arguments (argparse), 3 a step failed (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.abtest import interleave  # noqa: E402
from engine.drafter import new_drafter  # noqa: E402
from engine.loading import random_model  # noqa: E402
from engine.timing import sync  # noqa: E402
from engine.train import loop  # noqa: E402
from engine.train.drafter import target_outputs, ttt_loss  # noqa: E402
from engine.train.presets import FAMILIES, Preset, get_preset, names, target_config  # noqa: E402
from engine.train.target import autocast, lm_loss, make_optimizer  # noqa: E402

Step = Callable[[], None]


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor],
                   clip: float) -> Step:
    """One step as engine.train.loop.train takes it (loss, backward, clip, step), without the bookkeeping."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    return step


def target_step(preset: Preset, family: str, dev: torch.device) -> Step:
    run = preset.target_a
    model = random_model(target_config(preset, family), device=dev, seed=run.seed).train()
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, preset.vocab_size, (run.batch_size, run.seq_len + 1), generator=g).to(dev)

    def loss() -> torch.Tensor:
        with autocast(dev):
            return lm_loss(model, batch)
    return optimizer_step(model, make_optimizer(model, run.lr, run.weight_decay), loss, run.grad_clip)


def drafter_step(preset: Preset, family: str, dev: torch.device) -> Step:
    run = preset.drafter
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # as train_drafter loads the frozen target
    target = random_model(target_config(preset, family), device=dev, dtype=dtype, seed=0).requires_grad_(False)
    drafter = new_drafter(target.cfg, torch.arange(run.draft_vocab_size), target.embed_tokens, seed=run.seed,
                          device=dev).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, preset.vocab_size, (run.batch_size, run.seq_len), generator=g).to(dev)

    def loss() -> torch.Tensor:
        with autocast(dev):
            return ttt_loss(drafter, x, target_outputs(target, drafter, x), run.ttt_steps, run.step_decay)[0]
    return optimizer_step(drafter, make_optimizer(drafter, run.lr, run.weight_decay), loss, run.grad_clip)


def ms_per_step(step: Step, dev: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """Median ms of `steps` steps with deterministic kernels and `steps` without, after `warmup` untimed ones
    each, the two interleaved (engine.abtest: the engine's clock, the order reversed by turns)."""
    def in_mode(mode) -> Step:
        def run() -> None:
            with mode():
                step()
        return run

    seconds, _ = interleave({"deterministic": in_mode(loop.reproducible), "default": in_mode(contextlib.nullcontext)},
                            dev, steps, warmup)
    return {mode: 1000 * statistics.median(s) for mode, s in seconds.items()}


def top_ops(step: Step, dev: torch.device, steps: int, rows: int) -> list[dict]:
    """The ops (kernels on CUDA) with the most self time over `steps` deterministic steps, ms per step each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            with loop.reproducible():
                step()
        sync(dev)
    events = [e for e in prof.key_averages() if not cuda or e.device_type == DeviceType.CUDA]
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731
    total = sum(key(e) for e in events) or 1.0
    return [{"name": e.key, "self_ms": key(e) / 1000 / steps, "share": key(e) / total, "calls": e.count / steps}
            for e in sorted(events, key=key, reverse=True)[:rows]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=names(), default="gpu", help="training preset (default: gpu)")
    p.add_argument("--family", choices=FAMILIES, default="llama", help="target family (default: llama)")
    p.add_argument("--what", choices=("target", "drafter", "both"), default="both")
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler (default: 3)")
    p.add_argument("--rows", type=int, default=15, help="ops listed per model (default: 15)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of tables")
    a = p.parse_args(argv)
    if min(a.steps, a.profile_steps, a.rows) < 1 or a.warmup < 0:
        p.error("--steps, --profile-steps and --rows must be at least 1, --warmup at least 0")
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = get_preset(a.preset)
    out = {}
    try:
        for name, make in (("target", target_step), ("drafter", drafter_step)):
            if a.what not in (name, "both"):
                continue
            step = make(preset, a.family, dev)
            ms = ms_per_step(step, dev, a.warmup, a.steps)
            out[name] = {"deterministic_ms": ms["deterministic"], "default_ms": ms["default"],
                         "ops": top_ops(step, dev, a.profile_steps, a.rows)}
    except Exception as e:  # one line: which model, what failed
        print(f"profile-train: the {name} step failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}",
              file=sys.stderr)
        return 3
    if a.json:
        print(json.dumps({"preset": a.preset, "family": a.family, "device": str(dev), **out}))
        return 0
    for name, r in out.items():
        print(f"{name} ({a.preset} preset, {a.family}, {dev}): {r['deterministic_ms']:.1f} ms/step with "
              f"deterministic kernels, {r['default_ms']:.1f} without ({r['deterministic_ms'] / r['default_ms']:.2f}x)")
        print(f"  {'self ms/step':>12} {'share':>6} {'calls':>6}  op")
        for op in r["ops"]:
            print(f"  {op['self_ms']:12.3f} {op['share']:6.1%} {op['calls']:6.0f}  {op['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
