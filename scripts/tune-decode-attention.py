"""Sweep engine.decode_attention's Config on this GPU: each cut of the cache and block shape, timed in a CUDA graph
(as a decode step replays it), against SDPA and the current default, for the shapes the records decode.

    python3 scripts/tune-decode-attention.py [--json PATH]

Prints one table per shape (microseconds per call, fastest first) and the config that is fastest over all shapes by
total time. A tuning aid, not a record: the chosen config is measured end to end by baseline-decode.
Exit: 0 done, 2 no CUDA GPU or no Triton.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict

import torch

from engine import decode_attention as da
from engine.model import grouped_attention

# (name, query heads, KV heads, head dim, tokens, cache positions): the 8b and 1b shapes' decode at a 384-token cache
# (baseline-decode), a verify of 8 there, and the 8b shape's decode after a 32K-token prompt
SHAPES = [("8b decode S=384", 32, 8, 128, 1, 384), ("8b verify8 S=384", 32, 8, 128, 8, 384),
          ("1b decode S=384", 32, 8, 64, 1, 384), ("8b decode S=33024", 32, 8, 128, 1, 33024)]


def configs() -> list[da.Config]:
    grid = itertools.product((64, 128), (264, 528), (0, 512), (4, 8), (2, 3))
    return [da.Config(block_n=n, target_blocks=t, min_split=m, num_warps=w, num_stages=s) for n, t, m, w, s in grid]


def time_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1000


def sweep() -> dict[str, dict[str, float]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for name, H, kv, D, T, S in SHAPES:
        q = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, kv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        mask = torch.arange(S, device="cuda")[None, :] <= torch.arange(S - 64 - T, S - 64, device="cuda")[:, None]
        rows = q.reshape(1, kv, H // kv * T, D)
        want = grouped_attention(q, k, v, mask)
        row: dict[str, float] = {}
        da.enabled = False
        row["sdpa"] = time_us(lambda: grouped_attention(q, k, v, mask))
        da.enabled = True
        for cfg in configs():
            got = da.split_kv_attention(rows, k, v, mask, T, cfg).reshape(want.shape)
            if (got.float() - want.float()).abs().max().item() > 2e-2:
                raise SystemExit(f"{name}: {cfg} disagrees with SDPA")
            row[json.dumps(asdict(cfg))] = time_us(lambda c=cfg: da.split_kv_attention(rows, k, v, mask, T, c))
        out[name] = row
        print(f"{name}: sdpa {row['sdpa']:.2f} us, default {row[json.dumps(asdict(da.DEFAULT))]:.2f} us", flush=True)
    return out


def report(res: dict[str, dict[str, float]]) -> str:
    lines = []
    default = json.dumps(asdict(da.DEFAULT))
    for name, row in res.items():
        lines.append(f"\n{name}")
        for key, us in sorted(row.items(), key=lambda kv: kv[1])[:8]:
            lines.append(f"  {us:8.2f} us  {key}{'  (default)' if key == default else ''}")
        lines.append(f"  {row[default]:8.2f} us  default; sdpa {row['sdpa']:.2f} us")
    keys = [k for k in next(iter(res.values())) if k != "sdpa"]
    total = {k: sum(r[k] for r in res.values()) for k in keys}
    best = min(total, key=total.get)
    lines.append(f"\nfastest over all shapes: {best} ({total[best]:.2f} us in all; default {total[default]:.2f} us)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write every timing here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or da.triton is None:
        print("needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    res = sweep()
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
