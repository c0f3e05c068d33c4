"""What the GPU scripts of scripts/ (bench-gemv.py, bench-moe-decode.py, ab-kernels.py, ab-decode.py,
kernel-report.py) share: their refusal without a GPU (exit 3), timing calls inside one CUDA graph, which holds
`replays` rounds of them so that launch gaps weigh as they do in a captured decode step, and a shape's products."""
from __future__ import annotations

import sys
import argparse
from collections.abc import Callable, Sequence

import torch

from engine.config import ModelConfig
from engine.shapes import SHAPES

NO_CUDA = 3  # the exit code of a GPU benchmark on a machine without one


def cuda_missing(what: str) -> bool:
    """True, with a one-line reason on stderr, where this machine has no CUDA device; `what` says what the script
    would time there."""
    if torch.cuda.is_available():
        return False
    print(f"no CUDA device here: {what}", file=sys.stderr)
    return True


def graph_of(calls: Sequence[Callable[[], object]], replays: int) -> torch.cuda.CUDAGraph:
    """One graph of `replays` rounds of the calls, after one eager round (compiles the kernels, warms the
    allocator)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            for c in calls:
                c()
    return g


def us_per_call(g: torch.cuda.CUDAGraph, calls: int) -> float:
    """Microseconds per call of one replay of a graph of `calls` calls (every round's), by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def products(shape: str) -> list[tuple[str, int, int]]:
    """(name, outputs, inputs) of one layer's one-row products and the lm_head."""
    c = ModelConfig(**SHAPES[shape])
    h = c.hidden_size
    if c.is_mla:
        qk = c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        return [("wa (q_a + kv_a)", c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim, h),
                ("q_b_proj", qk, c.q_lora_rank), ("o_proj", h, c.num_attention_heads * c.v_head_dim),
                ("dense w13", 2 * c.intermediate_size, h), ("dense down", h, c.intermediate_size),
                ("lm_head", c.vocab_size, h)]
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [("wqkv", q + 2 * kv, h), ("o_proj", h, q), ("w13", 2 * c.intermediate_size, h),
            ("down_proj", h, c.intermediate_size), ("lm_head", c.vocab_size, h)]


def add_shape_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="llama-3.1-8b,llama-3.2-1b,deepseek-v3-mini",
                   help="shapes of engine/shapes.py, comma-separated")


def shapes_of(p: argparse.ArgumentParser, value: str) -> list[str]:
    """The --shape list, or exit 2 (p.error) naming the unknown ones."""
    shapes = [s for s in value.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        p.error(f"--shape: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(SHAPES)}")
    return shapes
