#!/usr/bin/env python3
"""A/B of the drafter's data regeneration: `engine.train.drafter.regenerate` with cuda_graphs=False (A: eager, one
Python step per token) against its default (B: each step after the prefill one replay of a CUDA graph), on a preset's
target shape with random weights, interleaved in one process and judged by the paired 2-of-3 rule; and whether the
two give the same tokens. Regeneration is a large share of a GPU drafter training (train-drafter's progress bar
shows it): this is the measurement behind the captured default, to repeat on a new card or torch.

    python scripts/ab-regen.py [--preset gpu] [--family llama,deepseek_v3] [--samples 512] [--rounds 2]
        [--tolerance 0.02] [--expect not-slower|faster|same] [--json]

A sample is one regeneration of --samples sequences (the preset drafter run's seq_len, regen_tokens and regen_batch)
from windows of a random token stream: no corpus, no training. The output is a measurement to decide with, not a
record; a B that changes tokens is reported (`same_tokens`): the captured default would then change every training's
data.

Exit: 0 B's verdict is one --expect names for every family (default: not slower) and its tokens equal A's; 1 not;
2 bad arguments; 3 no CUDA device here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TQDM_DISABLE", "1")  # regenerate's progress bar, once per sample: noise here

import torch  # noqa: E402

from engine.abtest import ab  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.loading import random_model  # noqa: E402
from engine.train.drafter import regenerate  # noqa: E402
from engine.train.presets import FAMILIES, get_preset, target_config, with_overrides  # noqa: E402
from gpu_bench import B_FAILS, NO_CUDA, add_ab_options, check_ab_options, cuda_missing, judged  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpu", help="a training preset (engine/train/presets.py) [default: gpu]")
    p.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    p.add_argument("--samples", type=int, default=512,
                   help="sequences regenerated per sample [default: 512, one regen_batch of the gpu preset]")
    add_ab_options(p, rounds=False)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per pair (default 2; three pairs)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    try:
        a.run = with_overrides(get_preset(a.preset).drafter, samples=a.samples)
    except EngineError as e:
        p.error(f"--preset: {e}")
    a.families = [f for f in a.family.split(",") if f]
    if not a.families or any(f not in FAMILIES for f in a.families):
        p.error(f"--family: comma-separated, of {', '.join(FAMILIES)}; not {a.family!r}")
    if a.samples < 1:
        p.error("--samples at least 1")
    check_ab_options(p, a)
    return a


def family_ab(a: argparse.Namespace, family: str, dev: torch.device) -> dict:
    """One family's A/B: the verdict of B's seconds against A's, the rates and whether the tokens agree."""
    preset, run = get_preset(a.preset), a.run
    target = random_model(target_config(preset, family), dev, torch.bfloat16, seed=0).requires_grad_(False)
    stream = torch.randint(0, preset.vocab_size, (1 << 20,), generator=torch.Generator().manual_seed(0))
    got = {}

    def eager():
        got["A"] = regenerate(target, stream, run, cuda_graphs=False)

    def captured():
        got["B"] = regenerate(target, stream, run)

    samples = ab(eager, captured, dev, rounds=a.rounds, warmup=1)
    out, code = judged(samples, a.tolerance, a.expect)
    steps = run.samples * run.regen_tokens  # sequence-tokens generated per sample
    same = got["A"].shape == got["B"].shape and bool(torch.equal(got["A"], got["B"]))
    rows = (got["A"] == got["B"]).all(1).float().mean().item() if got["A"].shape == got["B"].shape else 0.0
    return {**out, "family": family, "a_tokens_per_s": steps / statistics.median(samples.a),
            "b_tokens_per_s": steps / statistics.median(samples.b), "same_tokens": same, "same_rows": rows,
            "passes": code == 0 and same}


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this A/B times regeneration with and without CUDA graphs"):
        return NO_CUDA
    dev = torch.device("cuda")
    results = [family_ab(a, f, dev) for f in a.families]
    ok = all(r["passes"] for r in results)
    info = {"preset": a.preset, "samples": a.run.samples, "seq_len": a.run.seq_len, "regen_tokens": a.run.regen_tokens,
            "regen_batch": a.run.regen_batch, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.json:
        print(json.dumps({**info, "families": results}, indent=1))
        return 0 if ok else B_FAILS
    print(f"regeneration, A eager against B captured: preset {a.preset}, {a.run.samples} sequences of "
          f"{a.run.seq_len} tokens ({a.run.regen_tokens} generated, batches of {a.run.regen_batch}), "
          f"{info['gpu']} (torch {info['torch']}), 3 pairs of {a.rounds} rounds")
    for r in results:
        print(f"{r['family']:12s} A {r['a_tokens_per_s']:9.0f} tok/s   B {r['b_tokens_per_s']:9.0f} tok/s   "
              f"time B/A by pair: {' '.join(f'{x:.3f}' for x in r['pair_ratios'])}: B is {r['verdict']}; "
              f"same tokens: {r['same_tokens']} ({r['same_rows']:.1%} of sequences)")
    return 0 if ok else B_FAILS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
