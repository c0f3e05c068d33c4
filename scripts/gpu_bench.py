"""What the GPU benchmarks of scripts/ (bench-moe-decode.py, ab-kernels.py, ab-decode.py) share: their refusal
without a GPU (exit 3), and timing calls inside one CUDA graph, which holds `replays` rounds of them so that launch
gaps weigh as they do in a captured decode step."""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

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
