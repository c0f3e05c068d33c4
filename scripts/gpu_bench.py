"""What the GPU scripts of scripts/ (bench-gemv.py, bench-moe-decode.py, ab-kernels.py, ab-decode.py,
kernel-report.py, bench-router.py) share: their refusal without a GPU (exit 3), calls inside one CUDA graph, which
holds `replays` rounds of them so that launch gaps weigh as they do in a captured decode step, a shape's products,
and an A/B's options, verdict and exit code: engine.abtest's interleaved samples judged by specbook.judge's paired
2-of-3 rule (the one `runbook verify` applies)."""
from __future__ import annotations

import sys
import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.abtest import ABSamples, interleave  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from engine.kernels import Kernels  # noqa: E402
from engine.shapes import SHAPES  # noqa: E402
from specbook import judge  # noqa: E402

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


def us_per_call(graphs: dict[str, torch.cuda.CUDAGraph], calls: int, samples: int) -> dict[str, list[float]]:
    """Microseconds per call of each graph (`calls` calls a replay), `samples` interleaved replays each
    (engine.abtest.interleave: the order reversed every other round, the engine's clock)."""
    seconds, _ = interleave({name: g.replay for name, g in graphs.items()}, torch.device("cuda"), samples, warmup=0)
    return {name: [t * 1e6 / calls for t in ts] for name, ts in seconds.items()}


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


# ---- A/B: options, verdict, exit code ---------------------------------------------------------------------------
EXPECT = {"not-slower": ("same", "faster"), "faster": ("faster",), "same": ("same",)}
B_FAILS = 1  # the exit code when B's verdict is not the one asked for (slower, flaky, ...)


def add_ab_options(p: argparse.ArgumentParser, tolerance: float = 0.02, rounds: bool = True) -> None:
    """The rule takes three pairs; --rounds is the interleaved rounds a pair's ratio is the median of."""
    if rounds:
        p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per pair (default 3; three pairs)")
    p.add_argument("--tolerance", type=float, default=tolerance,
                   help=f"a pair's ratio B/A within 1 +- this is a vote for 'same' (default {tolerance})")
    p.add_argument("--expect", choices=list(EXPECT), default="not-slower",
                   help="the verdict exit 0 stands for (default not-slower: same or faster)")


def check_ab_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if getattr(a, "rounds", 1) < 1 or not 0 < a.tolerance < 1:
        p.error("--rounds at least 1, --tolerance in (0, 1)")


def kernels_of(p: argparse.ArgumentParser, option: str, text: str) -> Kernels:
    """A --a / --b value (CHOICE=VALUE,...; empty: the engine's defaults), or exit 2 naming what is wrong."""
    try:
        return Kernels.parse(text)
    except EngineError as e:
        p.error(f"{option}: {e}")


def judged(samples: ABSamples, tolerance: float, expect: str) -> tuple[dict, int]:
    """(the samples with the verdict, exit code): the pairs' ratios of B's seconds over A's under the paired 2-of-3
    rule; exit 0 when the verdict is one `expect` names, else B_FAILS."""
    verdict = judge.ab_verdict(samples.pair_ratios(), "lower", tolerance)
    return ({**samples.as_dict(), "tolerance": tolerance, "verdict": verdict, "expect": expect},
            0 if verdict in EXPECT[expect] else B_FAILS)
