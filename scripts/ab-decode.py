#!/usr/bin/env python3
"""A/B of two kernel choices (engine/kernels.py) on the compiled decode (or a compiled speculation cycle),
interleaved in one process, judged by the paired 2-of-3 rule: whether an engine change pays before it is recorded
(docs/game-plan.md, next steps).

    python scripts/ab-decode.py [--a CHOICE=VALUE,...] --b CHOICE=VALUE,... [--shape llama-3.1-8b]
        [--spec STEPS,TOPK[,TOKENS]] [--prompt-len 128] [--new-tokens 256] [--rounds 3] [--tolerance 0.02]
        [--expect not-slower|faster|same] [--json]
    e.g. --b verify_linear=few_rows --spec 7,1,8     (A: the engine's defaults)

One model (random weights, bf16) is built with A's choices and shares its weights with B's (Transformer.with_kernels);
one compiled decoder of each is captured in its own CUDA graph; then engine.abtest takes three pairs of --rounds
interleaved rounds (A B, B A, ...; a generation each, greedy), so a change of the GPU's clock hits both alike. A
sample is a generation's decode seconds per token (with --spec per verify cycle, whatever the drafts accepted: a
random drafter's are almost always rejected; engine.metrics turns a cycle's cost into the accept length it needs).
Each pair's ratio of B's median to A's is a vote against the tolerance (specbook/judge.py, the rule `runbook verify`
applies): two of three decide "same", "slower" or "faster"; no two agree: "flaky". The greedy tokens of A and B are
compared too: a choice that only changes speed gives the same tokens, one that changes roundings may not (reported,
not judged). The output is a measurement to decide with, not a record.

Exit: 0 B's verdict is one --expect names (default: not slower); 1 it is not (slower, flaky, ...); 2 bad arguments;
3 no CUDA device here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.abtest import ab  # noqa: E402
from engine.bench import random_prompt  # noqa: E402
from engine.drafter import new_drafter  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.loading import random_model  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from engine.speculate import SpecDecoder  # noqa: E402
from engine.target_decoder import TargetDecoder  # noqa: E402
from engine.tree import TreeShape  # noqa: E402
from gpu_bench import NO_CUDA, add_ab_options, check_ab_options, cuda_missing, judged, kernels_of  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default="", help="A's kernel choices, CHOICE=VALUE,... [default: the engine's]")
    p.add_argument("--b", required=True, help="B's kernel choices, CHOICE=VALUE,...")
    p.add_argument("--shape", default="llama-3.1-8b", help="a shape of engine/shapes.py")
    p.add_argument("--spec", help="STEPS,TOPK[,TOKENS]: time a compiled EAGLE-3 cycle of this tree (random drafter) "
                   "instead of the decode; a chain of 7 is 7,1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    add_ab_options(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    a.kernels_a, a.kernels_b = kernels_of(p, "--a", a.a), kernels_of(p, "--b", a.b)
    if a.kernels_a == a.kernels_b:
        p.error(f"--a and --b choose the same kernels ({a.kernels_a})")
    if a.shape not in SHAPES:
        p.error(f"--shape: one of {', '.join(SHAPES)}")
    a.tree = None
    if a.spec is not None:
        try:
            a.tree = TreeShape.make(*(int(v) for v in a.spec.split(",")))
        except (ValueError, TypeError, EngineError) as e:
            p.error(f"--spec: STEPS,TOPK[,TOKENS] of a valid tree, not {a.spec!r} ({e})")
    if a.prompt_len < 1 or a.new_tokens < 2:
        p.error("--prompt-len at least 1, --new-tokens at least 2")
    check_ab_options(p, a)
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this A/B times the compiled CUDA-graph decode"):
        return NO_CUDA
    dev = torch.device("cuda")
    model_a = random_model(a.shape, dev, torch.bfloat16, seed=0, kernels=a.kernels_a)
    models = {"A": model_a, "B": model_a.with_kernels(a.kernels_b)}
    extra = a.tree.draft_tokens if a.tree else 0
    max_seq_len = -(-(a.prompt_len + a.new_tokens + extra) // 128) * 128  # as engine.bench sizes its cache
    prompt = random_prompt(model_a.cfg.vocab_size, a.prompt_len, 0)

    def decoder(model):
        if a.tree is None:
            return TargetDecoder(model, max_seq_len, cuda_graphs=True, compile=True)
        drafter = new_drafter(model.cfg, torch.arange(min(32000, model.cfg.vocab_size)), embedding=model.embed_tokens,
                              seed=0, device=dev, dtype=torch.bfloat16, kernels=model.kernels)
        return SpecDecoder(model, drafter, max_seq_len, a.tree.steps, a.tree.topk, a.tree.draft_tokens, compile=True)

    decoders = {side: decoder(m) for side, m in models.items()}
    tokens = {side: d.generate(prompt, a.new_tokens, seed=0).token_ids for side, d in decoders.items()}  # captures

    def sample(side: str):
        def run() -> float:  # seconds per token (per verify cycle with --spec), the generation's own clock
            r = decoders[side].generate(prompt, a.new_tokens, seed=0)
            return r.decode_s / (r.verify_cycles if a.tree else r.decode_tokens)
        return run

    samples = ab(sample("A"), sample("B"), dev, rounds=a.rounds, warmup=0)
    out, code = judged(samples, a.tolerance, a.expect)
    unit = "cycles/s" if a.tree else "tok/s"
    what = f"compiled EAGLE-3 cycle of tree {a.spec}" if a.tree else "compiled decode"
    out.update({"a_kernels": a.kernels_a.as_dict(), "b_kernels": a.kernels_b.as_dict(), "shape": a.shape,
                "measured": what, "unit": unit, "a_rate": 1 / statistics.median(samples.a),
                "b_rate": 1 / statistics.median(samples.b), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                "same_tokens": tokens["A"] == tokens["B"]})
    if a.json:
        print(json.dumps(out, indent=1))
        return code
    print(f"A ({a.kernels_a}) against B ({a.kernels_b}) on {a.shape}, {what}, prompt {a.prompt_len}, "
          f"{a.new_tokens} new tokens, {torch.cuda.get_device_name()} (torch {torch.__version__}), 3 pairs of "
          f"{a.rounds} rounds")
    print(f"A {out['a_rate']:.1f} {unit}   B {out['b_rate']:.1f} {unit}   same greedy tokens: {out['same_tokens']}")
    print("time B/A by pair: " + " ".join(f"{x:.4f}" for x in out["pair_ratios"])
          + f"   (tolerance {a.tolerance}): B is {out['verdict']}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
