#!/usr/bin/env python3
"""The decode kernels of an older revision against this tree's, per call, interleaved in CUDA graphs on a GPU: what
an engine change to engine/decode_attention.py or engine/moe_decode.py buys, kernel by kernel, before it is
recorded (docs/findings.md, section 23 quotes such a run).

    mkdir -p .ab && git show REV:engine/decode_attention.py > .ab/decode_attention.py \\
                 && git show REV:engine/moe_decode.py > .ab/moe_decode.py
    python scripts/ab-kernels.py --old .ab [--samples 9] [--json]     (on a lent GPU: carry .ab)

For each module found in --old:
- decode_attention: split_kv_attention at the llama-3.1-8b shape's decode (384-token cache), after a 32K-token
  prompt, a verify of 8 (after a short prompt and after a 32K one), and the llama-3.2-1b shape's
  decode; this tree's with the cache's merge counts;
- moe_decode: the deepseek-v3-mini experts at one token and at eight, routed and shared experts as
  deepseek.Experts runs them at each revision (the shared MLP apart where that module takes no `shared`).
Each call runs once per layer of a graph (each layer its own inputs, so weights and caches come from memory, not
L2), the graph replayed 10 times a sample; samples of old and new alternate (engine.abtest). Reports the median
microseconds per call of each, new/old, the samples' spread (max/min), and new's verdict against old by the paired
2-of-3 rule (specbook/judge.py: the samples in three blocks, each block's ratio of medians a vote against
--tolerance). It also says whether old and new give the same bits.

The output is a measurement to decide with, not a record.

Exit: 0 every case's verdict is one --expect names (default: new not slower); 1 some case's is not; 2 bad arguments;
3 no CUDA device here.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.abtest import ABSamples  # noqa: E402
from gpu_bench import (NO_CUDA, add_ab_options, check_ab_options, cuda_missing, graph_of, judged,  # noqa: E402
                       us_per_call)

MODULES = ("decode_attention", "moe_decode")
REPLAYS = 10
# (label, query heads, KV heads, head dim, cache length, valid positions, tokens, layers a graph)
ATTENTION_CASES = [("llama-3.1-8b decode", 32, 8, 128, 384, 300, 1, 32),
                   ("llama-3.1-8b after 32K", 32, 8, 128, 33024, 32900, 1, 8),
                   ("llama-3.1-8b verify of 8", 32, 8, 128, 384, 300, 8, 32),
                   ("llama-3.1-8b verify of 8 after 32K", 32, 8, 128, 33024, 32900, 8, 8),
                   ("llama-3.2-1b decode", 32, 8, 64, 384, 300, 1, 16)]
MOE_LAYERS = 11  # deepseek-v3-mini's MoE layers


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path,
                   help="a directory holding the older decode_attention.py and/or moe_decode.py")
    p.add_argument("--samples", type=int, default=9, help="interleaved samples of each (default 9: three pairs of 3)")
    add_ab_options(p, rounds=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    if not a.old.is_dir():
        p.error(f"--old: no directory {a.old}")
    a.found = [m for m in MODULES if (a.old / f"{m}.py").is_file()]
    if not a.found:
        p.error(f"--old: {a.old} holds none of {', '.join(m + '.py' for m in MODULES)}")
    if a.samples < 3:
        p.error("--samples at least 3")
    check_ab_options(p, a)
    return a


def load_old(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"old_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def takes(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def compare(case: str, old: list[Callable], new: list[Callable], samples: int, tolerance: float, expect: str
            ) -> dict:
    with torch.no_grad():
        same = torch.equal(old[0](), new[0]())
        graphs = {"old": graph_of(old, REPLAYS), "new": graph_of(new, REPLAYS)}
    times = us_per_call(graphs, REPLAYS * len(old), samples)
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    rounds = samples // 3
    verdict, code = judged(ABSamples(times["old"][:3 * rounds], times["new"][:3 * rounds], [], 3, rounds), tolerance,
                           expect)
    return {"case": case, "old_us": o, "new_us": n, "new_over_old": n / o, "same_bits": same,
            "verdict": verdict["verdict"], "pair_ratios": verdict["pair_ratios"], "ok": code == 0,
            "spread_old": max(times["old"]) / min(times["old"]), "spread_new": max(times["new"]) / min(times["new"])}


def attention_rows(old: ModuleType, opts: tuple, gen: torch.Generator) -> list[dict]:
    from engine import decode_attention

    rows = []
    for label, heads, kv, dim, S, valid, T, layers in ATTENTION_CASES:
        q = [torch.randn(1, kv, heads // kv * T, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
             for _ in range(layers)]
        k = [torch.randn(1, kv, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
        v = [torch.randn(1, kv, S, dim, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(layers)]
        mask = torch.arange(S, device="cuda")[None, :] <= torch.arange(valid - T, valid, device="cuda")[:, None]
        old_counts = takes(old.split_kv_attention, "merge_counts")
        counts = [torch.zeros(kv, dtype=torch.int32, device="cuda") for _ in range(layers)]
        args = list(zip(q, k, v, counts))
        rows.append(compare(f"attention, {label}", [
            lambda q=q, k=k, v=v, c=c: old.split_kv_attention(q, k, v, mask, T, *([c] if old_counts else []))
            for q, k, v, c in args], [
            lambda q=q, k=k, v=v, c=c: decode_attention.split_kv_attention(q, k, v, mask, T, c)
            for q, k, v, c in args], *opts))
        del q, k, v
    return rows


def moe_rows(old: ModuleType, opts: tuple, gen: torch.Generator) -> list[dict]:
    from engine import moe_decode
    from engine.deepseek import Experts
    from engine.model import MLP
    from engine.shapes import SHAPES

    cfg = SHAPES["deepseek-v3-mini"]
    E, H, I, k = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    experts = Experts(E, H, I).cuda().bfloat16()
    mlp = MLP(H, I * cfg["n_shared_experts"]).cuda().bfloat16()
    with torch.no_grad():
        for t, fan_in in ((experts.gate_up_proj, H), (experts.down_proj, I), (mlp.w13.weight, H),
                          (mlp.down_proj.weight, I * cfg["n_shared_experts"])):
            t.normal_(0, fan_in ** -0.5, generator=gen)

    def run(module: ModuleType, x, w, idx) -> torch.Tensor:
        """Routed and shared experts as deepseek.Experts runs them with that revision's module."""
        fused = takes(module.routed_experts, "shared") and x.shape[0] <= getattr(module, "SHARED_MAX_TOKENS", 0)
        if fused:
            return module.routed_experts(x, w, idx, experts.gate_up_proj, experts.down_proj,
                                         shared=(mlp.w13.weight, mlp.down_proj.weight))
        return module.routed_experts(x, w, idx, experts.gate_up_proj, experts.down_proj) + mlp(x)

    rows = []
    for n in (1, 8):
        inputs = [(torch.randn(n, H, device="cuda", generator=gen).bfloat16(),
                   torch.rand(n, k, device="cuda", generator=gen),
                   torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(n)]))
                  for _ in range(MOE_LAYERS)]
        rows.append(compare(f"routed + shared experts, {n} token{'s' if n > 1 else ''}",
                            [lambda i=i: run(old, *i) for i in inputs],
                            [lambda i=i: run(moe_decode, *i) for i in inputs], *opts))
    return rows


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this A/B times GPU kernels"):
        return NO_CUDA
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.found:
        old = load_old(a.old / f"{name}.py", name)
        rows += (attention_rows if name == "decode_attention" else moe_rows)(old, (a.samples, a.tolerance, a.expect),
                                                                             gen)
    code = 0 if all(r["ok"] for r in rows) else 1
    if a.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "old": str(a.old),
                          "samples": a.samples, "tolerance": a.tolerance, "expect": a.expect, "rows": rows}, indent=1))
        return code
    print(f"old kernels from {a.old} against this tree's, {torch.cuda.get_device_name()} (torch {torch.__version__}), "
          f"median of {a.samples} interleaved samples, microseconds per call; verdict of new at tolerance "
          f"{a.tolerance}")
    print(f"{'case':<44} {'old':>9} {'new':>9} {'new/old':>8} {'spread':>13}  same bits  verdict")
    for r in rows:
        print(f"{r['case']:<44} {r['old_us']:>9.2f} {r['new_us']:>9.2f} {r['new_over_old']:>8.3f} "
              f"{r['spread_old']:>6.3f}/{r['spread_new']:<6.3f}  {str(r['same_bits']):<9}  {r['verdict']}")
    return code

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
