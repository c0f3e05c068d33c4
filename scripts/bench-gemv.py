#!/usr/bin/env python3
"""Time a decode step's one-row products per shape, and a verify's few-row ones: cuBLAS (F.linear) against
engine/gemv.py's kernels at several block sizes and warp counts, on a GPU (issue 18: decode nearer the bandwidth
limit, verify as cheap as decode). The variant marked (engine) is what engine.gemv.Linear runs at that product's
width and row count (engine.gemv.blocks, engine.gemv.few_row_blocks).

    python scripts/bench-gemv.py [--shape llama-3.1-8b,llama-3.2-1b,deepseek-v3-mini] [--rows 1,8,16,32,64]
        [--samples 7] [--json]

Each product of a shape (q/k/v, output, gate/up, down, lm_head; MLA's fused first projection and q_b for the MLA
shape) runs as one CUDA graph of calls on distinct copies of the weight (enough bytes that they come from HBM, not
L2), replayed 20 times per sample; the samples of every variant are interleaved, so a change of the GPU's clock hits
all alike. Reports the median microseconds per product, the bandwidth that implies against the weight's bytes, and
the spread (max/min) of the samples. The output is a measurement to decide with, not a record.

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
import torch.nn.functional as F  # noqa: E402

from engine import gemv  # noqa: E402
from gpu_bench import (NO_CUDA, add_shape_option, cuda_missing, graph_of, products, shapes_of,  # noqa: E402
                       us_per_call)

REPLAYS = 20
MIN_BYTES = 256 * 2 ** 20  # weight bytes per graph round: five times an H200's L2
# (block_n, block_k, num_warps) of the one-row kernel
CONFIGS = [(4, 2048, 8), (4, 1024, 4), (2, 1024, 4), (2, 2048, 8), (8, 1024, 4), (4, 512, 4)]
# (block_n, block_k, num_warps, num_stages) of the few-row kernel; block_m is the rows' (engine.gemv.few_row_blocks)
ROW_CONFIGS = [(32, 256, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 512, 4, 2), (64, 128, 4, 3),
               (64, 256, 8, 3)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_option(p)
    p.add_argument("--rows", default="1", help="tokens per product, comma-separated: 1 times the one-row kernel, "
                   f"2 to {gemv.FEW_ROWS_MAX} the few-row one (a verify of that many tokens)")
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    a.shapes = shapes_of(p, a.shape)
    try:
        a.row_counts = [int(r) for r in a.rows.split(",") if r]
    except ValueError:
        p.error(f"--rows: integers, comma-separated, not {a.rows!r}")
    if not a.row_counts or not all(1 <= r <= gemv.FEW_ROWS_MAX for r in a.row_counts):
        p.error(f"--rows: each from 1 to {gemv.FEW_ROWS_MAX}")
    if a.samples < 3:
        p.error("--samples at least 3")
    return a


def kernel_variants(x: torch.Tensor, ws: list[torch.Tensor]) -> dict[str, list]:
    """The engine's kernel at each config of the sweep, for x's row count, one call per weight copy."""
    m, k = x.shape
    out = {}
    if m == 1:
        for bn, bk, nw in CONFIGS:
            tag = f"gemv {bn}/{bk}/{nw}" + (" (engine)" if (bn, bk, nw) == gemv.blocks(k) else "")
            out[tag] = [lambda w=w, c=(bn, bk, nw): gemv.gemv(x, w, None, *c) for w in ws]
        return out
    engine = gemv.few_row_blocks(m, k, ws[0].shape[0])
    for bn, bk, nw, ns in ROW_CONFIGS:
        c = (engine[0], bn, bk, nw, ns)
        tag = f"rows {bn}/{bk}/{nw}/{ns}" + (" (engine)" if c == engine else "")
        out[tag] = [lambda w=w, c=c: gemv.gemm_few_rows(x, w, None, c) for w in ws]
    if engine[1:] not in [tuple(c) for c in ROW_CONFIGS]:
        out["rows {}/{}/{}/{} (engine)".format(*engine[1:])] = [lambda w=w: gemv.gemm_few_rows(x, w) for w in ws]
    return out


def time_product(n: int, k: int, m: int, samples: int, gen: torch.Generator) -> list[dict]:
    """cuBLAS and every config on copies of one [n, k] bf16 weight against m rows, interleaved samples."""
    copies = max(1, -(-MIN_BYTES // (2 * n * k)))
    ws = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16).normal_(0, k ** -0.5, generator=gen)
          for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    variants = {"cuBLAS": [lambda w=w: F.linear(x, w) for w in ws], **kernel_variants(x, ws)}
    with torch.no_grad():
        want = F.linear(x, ws[0]).float()
        err = {name: ((calls[0]().float() - want).abs().max() / want.abs().max()).item()
               for name, calls in variants.items()}
        graphs = {name: graph_of(calls, REPLAYS) for name, calls in variants.items()}
    times = us_per_call(graphs, REPLAYS * copies, samples)
    del graphs, ws
    return [{"variant": name, "us": statistics.median(t), "gb_s": 2 * n * k / statistics.median(t) / 1e3,
             "spread": max(t) / min(t), "rel_err_vs_cublas": err[name]} for name, t in times.items()]


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if cuda_missing("this benchmark times GPU kernels"):
        return NO_CUDA
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for shape in a.shapes:
        for m in a.row_counts:
            for name, n, k in products(shape):
                engine_takes = n * k <= gemv.MAX_WEIGHT
                out.append({"shape": shape, "product": name, "n": n, "k": k, "m": m,
                            "engine": ("gemv" if m == 1 else "rows") if engine_takes else "cuBLAS",
                            "variants": time_product(n, k, m, a.samples, gen)})
    if a.json:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "samples": a.samples,
                          "products": out}, indent=1))
        return 0
    print(f"products of {a.rows} rows, {torch.cuda.get_device_name()} (torch {torch.__version__}), "
          f"median of {a.samples} "
          f"interleaved samples")
    for p in out:
        print(f"\n{p['shape']} {p['product']} [{p['n']} x {p['k']}] at {p['m']} rows, the engine runs {p['engine']}")
        print(f"{'variant':<26} {'us':>9} {'GB/s':>8} {'spread':>7} {'err vs cuBLAS':>14}")
        for r in p["variants"]:
            print(f"{r['variant']:<26} {r['us']:>9.2f} {r['gb_s']:>8.0f} {r['spread']:>7.3f} "
                  f"{r['rel_err_vs_cublas']:>14.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
