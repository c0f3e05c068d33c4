#!/usr/bin/env python3
"""How far apart two runs of the same engine land on this machine, by how they are paired: the noise an A/B of
`runbook verify` has to see a change through (docs/findings.md, section 21).

    python scripts/ab-noise.py [--pairs 5] [--generations 20] [--hogs 2] [--shape small] [--json]

Each pair is two processes of the very same engine, each timing --generations greedy decodes of 32 tokens on one
thread (the CPU-time clock of engine.timing; the median is its result), paired three ways:
- in turn: A, then B (how verify paired runs on every machine before);
- side by side: A and B started together, running free;
- side by side, in turns: started together, each generation a timed section under one timing lock
  (engine.quiet), so A's and B's generations alternate and neither times while the other works (how verify pairs
  runs on a machine without GPUs where the engine keeps the lock).
Every ratio B/A would be 1 on a quiet, steady machine. Reported per way: the ratios, and their spread as the root
mean square of log(B/A) - about the relative error of one pair; a verdict's tolerance must stand well above it.
--hogs starts that many CPU-burning processes beside the pairs, as tests/test_verify_planted.py does.

Exit: 0 measured; 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("in turn", "side by side", "side by side, in turns")


def child(shape: str, generations: int) -> None:
    """One process: load the engine, time the generations, print the median tok/s."""
    import torch

    from engine import quiet
    from engine.bench import random_prompt
    from engine.runtime import Engine
    from engine.target_decoder import TargetDecoder

    torch.set_num_threads(1)
    eng = Engine.load(shape=shape, device="cpu", dtype="float32", max_seq_len=64)
    dec = TargetDecoder(eng.model, eng.max_seq_len, cuda_graphs=True)
    prompt = random_prompt(eng.model.cfg.vocab_size, 16, 0)
    dec.generate(prompt, 8, seed=0)
    rates = []
    for _ in range(generations):
        with quiet.timed():
            rates.append(dec.generate(prompt, 32, seed=0).tok_s)
    print(statistics.median(rates))


def start(args: argparse.Namespace, lock: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECBOOK_TIMING")}
    if lock:
        env.update({"SPECBOOK_TIMING_LOCK": lock, "SPECBOOK_TIMING_ROLE": "timer"})
    return subprocess.Popen([sys.executable, __file__, "--child", "--shape", args.shape,
                             "--generations", str(args.generations)], stdout=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)


def result(p: subprocess.Popen) -> float:
    out, _ = p.communicate()
    if p.returncode:
        raise SystemExit(f"ab-noise: a timing process exited {p.returncode}")
    return float(out.strip().splitlines()[-1])


def pair(args: argparse.Namespace, way: str, lock: str) -> float:
    if way == "in turn":
        a = result(start(args, None))
        return result(start(args, None)) / a
    held = lock if way.endswith("in turns") else None
    pa, pb = start(args, held), start(args, held)
    a = result(pa)
    return result(pb) / a


def spread(ratios: list[float]) -> float:
    return math.sqrt(sum(math.log(r) ** 2 for r in ratios) / len(ratios))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=5, help="pairs per way (default 5)")
    p.add_argument("--generations", type=int, default=20, help="timed generations per process (default 20)")
    p.add_argument("--hogs", type=int, default=2, help="CPU-burning processes beside the pairs (default 2)")
    p.add_argument("--shape", default="small", help="engine.shapes name (default small)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.shape, args.generations)
        return 0
    if args.pairs < 1 or args.generations < 1 or args.hogs < 0:
        p.error("--pairs and --generations must be at least 1, --hogs at least 0")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    ratios: dict[str, list[float]] = {w: [] for w in WAYS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            lock = str(Path(tmp) / "timing.lock")
            for i in range(args.pairs):  # the ways take turns, so a slow hour hits each alike
                for way in WAYS:
                    ratios[way].append(pair(args, way, lock))
                    if not args.json:
                        print(f"pair {i + 1}/{args.pairs}, {way}: B/A {ratios[way][-1]:.3f}", file=sys.stderr)
    finally:
        for h in hogs:
            h.kill()
    out = {"shape": args.shape, "hogs": args.hogs, "generations": args.generations, "cpus": os.cpu_count(),
           "ways": {w: {"ratios": r, "rms_log_ratio": spread(r)} for w, r in ratios.items()}}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{'pairing':<24} {'rms log(B/A)':>12}  ratios B/A")
        for w, r in ratios.items():
            print(f"{w:<24} {spread(r):>12.3f}  {', '.join(f'{x:.3f}' for x in r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
