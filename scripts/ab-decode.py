#!/usr/bin/env python3
"""A/B of one engine switch on the compiled decode (or a compiled speculation cycle), interleaved in one process:
whether an engine change pays before it is recorded (docs/game-plan.md, next steps).

    python scripts/ab-decode.py --switch engine.decode_attention.fuse_merge [--shape llama-3.1-8b]
        [--spec STEPS,TOPK[,TOKENS]] [--prompt-len 128] [--new-tokens 256] [--rounds 7] [--json]

The switch is a module-level bool of the engine (`enabled`, `fuse_merge` of engine.decode_attention,
`fuse_shared` of engine.moe_decode). One model (random weights, bf16) is loaded; one compiled decoder is captured
with the switch off (A) and one with it on (B), each in its own CUDA graph; then each round times one greedy
generation of each, in alternating order, so a change of the GPU's clock hits both alike. Reports each side's median
tok/s, the ratio B/A of every round, and their median and spread (max/min of the ratios): a change pays when the
ratios stand clear of 1 by more than their spread. The greedy tokens of A and B are compared too: a switch that only
changes speed gives the same tokens, one that changes roundings may not (reported, not judged).

With --spec the generation is EAGLE-3's, compiled, with a random drafter of the shape at that tree (a chain is
STEPS,1,STEPS+1), and the rate compared is cycles a second: a cycle's draft steps, verify of TOKENS and bookkeeping,
whatever the drafts accepted (a random drafter's are almost always rejected). That is what a change of the verify's
products moves; engine.metrics turns a cycle's cost into the accept length it needs.

The output is a measurement to decide with, not a record.

Exit: 0 measured; 2 bad arguments; 3 no CUDA device here.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.bench import random_prompt  # noqa: E402
from engine.drafter import new_drafter  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.loading import random_model  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from engine.speculate import SpecDecoder  # noqa: E402
from engine.tree import TreeShape  # noqa: E402
from engine.target_decoder import TargetDecoder  # noqa: E402
from gpu_bench import NO_CUDA, cuda_missing  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch", required=True, help="MODULE.NAME of a module-level bool in engine/")
    p.add_argument("--shape", default="llama-3.1-8b", help="a shape of engine/shapes.py")
    p.add_argument("--spec", help="STEPS,TOPK[,TOKENS]: time a compiled EAGLE-3 cycle of this tree (random drafter) "
                   "instead of the decode; a chain of 7 is 7,1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    module, _, name = a.switch.rpartition(".")
    if not module.startswith("engine."):
        p.error(f"--switch: MODULE.NAME inside engine/, not {a.switch!r}")
    try:
        a.module = importlib.import_module(module)
    except ImportError as e:
        p.error(f"--switch: {e}")
    if not isinstance(getattr(a.module, name, None), bool):
        p.error(f"--switch: {module} has no module-level bool {name!r}")
    a.name = name
    if a.shape not in SHAPES:
        p.error(f"--shape: one of {', '.join(SHAPES)}")
    a.tree = None
    if a.spec is not None:
        try:
            a.tree = TreeShape.make(*(int(v) for v in a.spec.split(",")))
        except (ValueError, TypeError, EngineError) as e:
            p.error(f"--spec: STEPS,TOPK[,TOKENS] of a valid tree, not {a.spec!r} ({e})")
    if a.prompt_len < 1 or a.new_tokens < 2 or a.rounds < 3:
        p.error("--prompt-len at least 1, --new-tokens at least 2, --rounds at least 3")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this A/B times the compiled CUDA-graph decode"):
        return NO_CUDA
    model = random_model(a.shape, torch.device("cuda"), torch.bfloat16, seed=0)
    extra = a.tree.draft_tokens if a.tree else 0
    max_seq_len = -(-(a.prompt_len + a.new_tokens + extra) // 128) * 128  # as engine.bench sizes its cache
    prompt = random_prompt(model.cfg.vocab_size, a.prompt_len, 0)
    if a.tree:
        drafter = new_drafter(model.cfg, torch.arange(min(32000, model.cfg.vocab_size)),
                              embedding=model.embed_tokens, seed=0, device=model.device, dtype=torch.bfloat16)

        def decoder():
            return SpecDecoder(model, drafter, max_seq_len, a.tree.steps, a.tree.topk, a.tree.draft_tokens,
                               compile=True)

        def rate(res) -> float:  # cycles a second
            return res.verify_cycles / res.decode_s
    else:
        def decoder():
            return TargetDecoder(model, max_seq_len, cuda_graphs=True, compile=True)

        def rate(res) -> float:
            return res.tok_s
    original = getattr(a.module, a.name)
    sides = {}
    tokens = {}
    try:
        for label, value in (("A", False), ("B", True)):
            setattr(a.module, a.name, value)
            dec = decoder()
            tokens[label] = dec.generate(prompt, a.new_tokens, seed=0).token_ids  # compiles and captures
            sides[label] = (value, dec)
        samples: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(a.rounds):
            for label in ("A", "B") if r % 2 == 0 else ("B", "A"):
                value, dec = sides[label]
                setattr(a.module, a.name, value)  # anything outside the graph (prefill) runs as captured too
                samples[label].append(rate(dec.generate(prompt, a.new_tokens, seed=0)))
    finally:
        setattr(a.module, a.name, original)
    ratios = [b / x for x, b in zip(samples["A"], samples["B"])]
    unit = "cycles/s" if a.tree else "tok/s"
    what = f"compiled EAGLE-3 cycle of tree {a.spec}" if a.tree else "compiled decode"
    out = {"switch": a.switch, "shape": a.shape, "measured": what, "unit": unit, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
           "a": statistics.median(samples["A"]), "b": statistics.median(samples["B"]),
           "ratio": statistics.median(ratios), "spread": max(ratios) / min(ratios), "ratios": ratios,
           "samples": samples, "same_tokens": tokens["A"] == tokens["B"]}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{a.switch} on {a.shape}, {what}, prompt {a.prompt_len}, {a.new_tokens} new tokens, "
          f"{torch.cuda.get_device_name()} (torch {torch.__version__}), {a.rounds} rounds")
    print(f"A (off) {out['a']:.1f} {unit}   B (on) {out['b']:.1f} {unit}   "
          f"B/A {out['ratio']:.4f} (spread {out['spread']:.4f})   same greedy tokens: {out['same_tokens']}")
    print("B/A by round: " + " ".join(f"{x:.4f}" for x in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
