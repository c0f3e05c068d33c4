#!/usr/bin/env python3
"""Time the MoE decode kernels (engine/moe_decode.py) per block size and warp count, with the shared experts read
in the same launches or run apart as cuBLAS's products, against the grouped GEMM that deepseek.Experts runs for more
tokens, on a GPU, at the deepseek-v3-mini experts' shapes (issue 18: MLA + MoE decode). Every variant computes the
routed and the shared experts; the row marked (engine) is what deepseek.MoE runs.

    python scripts/bench-moe-decode.py [--tokens 1,8] [--layers 11] [--samples 7] [--json]

Each variant runs as one CUDA graph holding --layers expert calls, each with its own routing (so, as in a decode
step, the weights come from HBM, not L2), replayed 20 times per sample; samples of the variants are interleaved, so a
change of the GPU's clock hits all of them alike. Reports the median microseconds per layer, the bandwidth that
implies against the bytes of the distinct experts each call reads, and the spread (max/min) of the samples. The
output is a measurement to decide with, not a record: changing what deepseek.Experts runs is an engine change,
re-recorded like any other.

Exit: 0 measured; 2 bad arguments; 3 no CUDA device here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine import moe_decode  # noqa: E402
from engine.deepseek import Experts  # noqa: E402
from engine.model import MLP  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from gpu_bench import NO_CUDA, cuda_missing, graph_of, us_per_call  # noqa: E402

REPLAYS = 20
# (block_i, block_h, block_k, num_warps); the engine's own (engine/moe_decode.py) first
CONFIGS = [(4, 2, 1024, 4), (8, 2, 1024, 4), (8, 8, 512, 4), (8, 4, 512, 4), (4, 4, 512, 4), (16, 8, 256, 4),
           (8, 8, 512, 8), (16, 16, 256, 8), (4, 2, 512, 2)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v3-mini", help="an MoE shape of engine/shapes.py")
    p.add_argument("--tokens", default="1,8", help="token counts: 1 is a decode step, 8 a verify of 8")
    p.add_argument("--layers", type=int, default=11, help="expert calls per graph, each routed anew")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    try:
        a.tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: comma-separated integers, not {a.tokens!r}")
    if a.shape not in SHAPES or "n_routed_experts" not in SHAPES[a.shape]:
        p.error(f"--shape: an MoE shape ({', '.join(s for s in SHAPES if 'n_routed_experts' in SHAPES[s])})")
    if min(a.tokens) < 1 or a.layers < 1 or a.samples < 3:
        p.error("--tokens and --layers at least 1, --samples at least 3")
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this benchmark times GPU kernels"):
        return NO_CUDA
    cfg = SHAPES[a.shape]
    E, H, I, k = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ex = Experts(E, H, I).cuda().bfloat16()
    mlp = MLP(H, I * cfg["n_shared_experts"]).cuda().bfloat16()
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, H ** -0.5, generator=gen)
        ex.down_proj.normal_(0, I ** -0.5, generator=gen)
        mlp.w13.weight.normal_(0, H ** -0.5, generator=gen)
        mlp.down_proj.weight.normal_(0, (I * cfg["n_shared_experts"]) ** -0.5, generator=gen)
    expert_bytes = ex.expert_bytes()
    shared_bytes = sum(t.numel() * t.element_size() for t in mlp.parameters())
    shared = (mlp.w13.weight, mlp.down_proj.weight)
    rows = []
    for n in a.tokens:
        xs = [torch.randn(n, H, device="cuda", generator=gen).bfloat16() for _ in range(a.layers)]
        routes = [torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(n)])
                  for _ in range(a.layers)]
        ws = [torch.rand(n, k, device="cuda", generator=gen) for _ in range(a.layers)]
        # per layer: the distinct experts the call reads, and the shared experts
        read = sum(len(set(r.flatten().tolist())) for r in routes) * expert_bytes / a.layers + shared_bytes
        calls = list(zip(xs, ws, routes))
        variants = {"grouped GEMM, shared apart": [lambda x=x, w=w, r=r: ex._grouped(x, w, r) + mlp(x)
                                                   for x, w, r in calls]}
        engine = (moe_decode.BLOCK_I, moe_decode.BLOCK_H, moe_decode.BLOCK_K, moe_decode.NUM_WARPS)
        for bi, bh, bk, nw in CONFIGS:
            tag = f"moe_decode {bi}/{bh}/{bk} w{nw}"
            ours = (bi, bh, bk, nw) == engine  # and deepseek.Experts reads the shared experts in up to a token count
            fused = n <= moe_decode.SHARED_MAX_TOKENS
            variants[f"{tag} shared apart{' (engine)' if ours and not fused else ''}"] = [
                lambda x=x, w=w, r=r, bi=bi, bh=bh, bk=bk, nw=nw: moe_decode.routed_experts(
                    x, w, r, ex.gate_up_proj, ex.down_proj, bi, bh, bk, num_warps=nw) + mlp(x) for x, w, r in calls]
            variants[f"{tag} shared in{' (engine)' if ours and fused else ''}"] = [
                lambda x=x, w=w, r=r, bi=bi, bh=bh, bk=bk, nw=nw: moe_decode.routed_experts(
                    x, w, r, ex.gate_up_proj, ex.down_proj, bi, bh, bk, shared=shared, num_warps=nw)
                for x, w, r in calls]
        with torch.no_grad():
            want = [(ex._grouped(x, w, r) + mlp(x)).float() for x, w, r in calls]
            graphs = {name: graph_of(calls, REPLAYS) for name, calls in variants.items()}
            diffs = {name: max((c().float() - t).abs().max().item() for c, t in zip(fns, want))
                     for name, fns in variants.items()}
        samples = us_per_call(graphs, REPLAYS * a.layers, a.samples)
        for name, s in samples.items():
            us = statistics.median(s)
            rows.append({"tokens": n, "variant": name, "us_per_layer": us, "gb_s": read / us / 1e3,
                         "spread": max(s) / min(s), "max_abs_diff_vs_grouped": diffs[name]})
    if a.json:
        print(json.dumps({"shape": a.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "expert_bytes": expert_bytes, "shared_bytes": shared_bytes, "rows": rows}, indent=1))
        return 0
    print(f"{a.shape} experts on {torch.cuda.get_device_name()} (torch {torch.__version__}), {a.layers} layers a "
          f"graph, median of {a.samples} interleaved samples")
    print(f"{'tokens':>6}  {'variant':<44} {'us/layer':>9} {'GB/s':>7} {'spread':>7} {'|diff| vs grouped':>18}")
    for r in rows:
        print(f"{r['tokens']:>6}  {r['variant']:<44} {r['us_per_layer']:>9.1f} {r['gb_s']:>7.0f} "
              f"{r['spread']:>7.3f} {r['max_abs_diff_vs_grouped']:>18.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
